"""The runner: SchedulerOutput in, ModelRunnerOutput out, one jitted step in between.

Owns the device state (parameters split once, the KV cache and the token history, both
donated on every step), the compiled executables per bucket, and the persistent input batch
it keeps from scheduler messages. Never sees a scheduler `Request`.

A step is two halves so that the engine can overlap them (async scheduling):

    dispatch(so) -> PendingStep     host packing + one device dispatch; returns at once
    fetch(pending) -> ModelRunnerOutput   waits for that step's tokens and logprobs

`execute_model(so)` is the synchronous composition of the two.

The per-slot rows the step reads (block tables, bad words, allowed-token bits) stay on the
device between steps (`InputBatch.slot_rows()`, runner/device_rows.py); `run` sends only what
changed since the previous step, then the step itself. Every host-to-device byte of a step
(its arguments, those diffs, and the block copies and history rows `dispatch` sends first)
is counted as host bytes (under tensor parallelism each is replicated to every device of
the mesh): `last_step_h2d` (by part) and `total_h2d_bytes`.

A request that joins with num_computed_tokens > 0 (a prefix-cache hit) never runs its
cached positions, so the step never writes them into its token-history row, which the
penalties read. `dispatch` uploads the row from the host first (one small donated update,
compiled at warm-up like the buckets):

    host row (slot 2):    p0 p1 p2 p3 p4 p5 p6 p7 p8 p9
                          <-- cache hit: uploaded --> <- the step writes these ->
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxllm.kernels.backends import AttentionBackend, AttentionLayer
from jaxllm.kernels.linear_methods import LinearMethod, get_linear_method
from jaxllm.messages import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from jaxllm.models.base import AttentionMetadata
from jaxllm.models.llama import init_kv_caches
from jaxllm.runner import device_sleep
from jaxllm.models.parallel import ParallelOps
from jaxllm.models.sharding import kv_cache_sharding
from jaxllm.runner.buckets import BucketConfig
from jaxllm.runner.input_batch import HostStep, InputBatch
from jaxllm.runner.kv_cache import StepMemory, per_device_bytes
from jaxllm.runner.sampler import logprobs_lists
from jaxllm.runner.step import (BatchMetadata, CompiledFunctions, StepOutput,
                                abstract_slot_row_inputs, make_step_fn)
from jaxllm.runner.step_features import StepFeature
from jaxllm.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass
class PendingStep:
    """A dispatched step: its host packing and its (possibly still running) device outputs."""

    host: HostStep
    out: StepOutput


class ModelRunner:
    def __init__(self, model, *, num_blocks: int, block_size: int, kv_dtype, buckets: BucketConfig,
                 attention_backend: AttentionBackend, max_model_len: int, max_num_seqs: int,
                 eos_token_ids: tuple[int, ...], mesh,
                 logprobs_mode: str = "raw_logprobs", max_logprobs: int = MAX_LOGPROBS,
                 linear_method: LinearMethod | None = None,
                 features: tuple[StepFeature, ...] = ()):
        """linear_method: the one `model`'s weights went through after loading
        (LlamaForCausalLM.process_weights_after_loading); None: "xla", weights as loaded.
        features: the step features (runner/step_features.py, made by
        runner/features.make_step_features from the engine's research config)."""
        cfg = model.config
        self.model_config = cfg
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.buckets = buckets
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.attention_backend = attention_backend
        self.linear_method = linear_method or get_linear_method("xla")
        self.graphdef, self.state = nnx.split(model)
        # `mesh`: this runner's devices (1 without tensor parallelism). Caches are split over
        # KV heads (the model's layout makes them a multiple of the mesh size); host inputs
        # and every output the host reads are replicated over the mesh.
        rep = NamedSharding(mesh, PartitionSpec())
        self.replicated = rep
        self.kv_sharding = kv_cache_sharding(mesh)
        self.features = tuple(features)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, buckets.width_buckets[-1],
                                      block_size, eos_token_ids, cfg.vocab_size,
                                      self.features)
        self.slot_rows = self.input_batch.slot_rows()
        self.last_step_h2d: dict[str, int] = {}  # bytes of the last step, by part
        self.total_h2d_bytes = 0
        self._h2d_before_step: dict[str, int] = {}  # sent by dispatch ahead of the step
        self.reset_device_state()
        # What runs per shard; also what jaxllm.research.lens applies the LM head with.
        self.ops = ParallelOps(AttentionLayer(attention_backend, mesh), self.linear_method)
        self.step_fns = CompiledFunctions(
            make_step_fn(self.graphdef, self.ops,
                         logprobs_mode=logprobs_mode, max_logprobs=max_logprobs,
                         features=self.features),
            lambda T, W: (self.state, self.kv_caches, self.token_ids,
                          *abstract_slot_row_inputs(T, buckets.seqs_for(T), W,
                                                    self._slot_tables(), rep)))
        # One key, (): copies of cached tail blocks, up to one per new request of a step,
        # padded with null-block self-copies (block 0 onto itself changes nothing).
        self.copy_fns = CompiledFunctions(
            jax.jit(_copy_blocks, donate_argnums=0),
            lambda: (self.kv_caches,
                     *[jax.ShapeDtypeStruct((max_num_seqs,), jnp.int32, sharding=rep)] * 2))
        # One key, (): the whole-row upload of a slot's token history (see the docstring).
        self.history_fns = CompiledFunctions(
            jax.jit(_set_history_row, donate_argnums=0),
            lambda: (self.token_ids, jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                     jax.ShapeDtypeStruct((max_model_len,), jnp.int32, sharding=rep)))

    def reset_device_state(self) -> None:
        """Fresh (zero) KV cache and token history, and the per-slot rows rebuilt from their
        host mirrors: at start-up, and after a failed step consumed the donated ones (every
        request then recomputes)."""
        self.kv_caches = init_kv_caches(self.model_config, self.num_blocks, self.block_size,
                                        self.attention_backend.kv_storage_dtype(self.kv_dtype),
                                        self.kv_sharding)
        self.token_ids = jnp.zeros((self.max_num_seqs, self.max_model_len), jnp.int32,
                                   device=self.replicated)
        for rows in self.slot_rows.values():
            rows.place(self.replicated)

    def release_device_memory(self, keep_weights_on_host: bool):
        """Sleep mode: delete the weights' and the KV cache's device buffers; -> the host
        copy of the weights if asked for (runner/device_sleep.py)."""
        return device_sleep.release(self, keep_weights_on_host)

    def restore_device_memory(self, weights: bool, kv_cache: bool, host_weights,
                              reload_state) -> None:
        """Sleep mode's wake_up: the weights (from host_weights, else reload_state()) and/or
        a fresh KV cache back on the device."""
        if weights:
            device_sleep.restore_weights(self, host_weights, reload_state)
        if kv_cache:
            device_sleep.restore_kv_cache(self)

    def _slot_tables(self) -> dict[str, jax.Array]:
        return {name: rows.device for name, rows in self.slot_rows.items()}

    def device_state_ok(self) -> bool:
        """Did the KV cache, the token history and the per-slot rows survive (not donated to
        a step or an update that failed)?"""
        try:
            leaves = jax.tree.leaves((self.kv_caches, self.token_ids, self._slot_tables()))
            if any(a.is_deleted() for a in leaves):
                return False
            jax.block_until_ready(leaves)
            return True
        except Exception:  # an async failure surfaces here as the arrays' error
            return False

    @property
    def num_compiles(self) -> int:
        """Executables compiled so far: steps, block copies, history rows, row uploads."""
        return (self.step_fns.num_compiles + self.copy_fns.num_compiles
                + self.history_fns.num_compiles
                + sum(rows.num_compiles for rows in self.slot_rows.values()))

    def warmup(self, use_tqdm: bool = True) -> None:
        """Compile every bucket the engine can launch, so serving never compiles."""
        shapes = [(T, W) for T, _, W in self.buckets.all_shapes()]
        self.history_fns.get(())
        self.copy_fns.get(())
        for rows in self.slot_rows.values():
            rows.warmup()
        # XLA compiles without the GIL: one thread per core roughly divides the wall time.
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            futures = [pool.submit(self.step_fns.get, shape) for shape in shapes]
            for f in tqdm(as_completed(futures), total=len(futures), desc="Compiling buckets",
                          disable=not use_tqdm):
                f.result()

    # ---- memory: profile, then allocate the KV cache (vLLM's order) -----------------------

    def profile_run(self, num_blocks: int, keys: list[tuple] | None = None
                    ) -> dict[tuple, StepMemory | None]:
        """What the step needs beyond the persistent state (per device; None where XLA gives
        no memory analysis) at each bucket key (T, W), default the largest token bucket,
        compiled against an abstract KV cache of num_blocks blocks. Nothing is allocated or
        kept: the cache the runner holds (of any size, 0 blocks before
        `initialize_kv_cache`) only lends its per-layer dtype, shape and sharding."""
        T = self.buckets.token_buckets[-1]
        keys = keys if keys is not None else [(T, W) for W in self.buckets.width_buckets]
        held = self.kv_caches
        # The step's abstract arguments read self.kv_caches: lend them the profile's shape.
        self.kv_caches = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((num_blocks, *a.shape[1:]), a.dtype,
                                           sharding=a.sharding), held)
        try:
            persistent = self.persistent_bytes()
            return {key: StepMemory.of(self.step_fns.memory_analysis(key), persistent)
                    for key in keys}
        finally:
            self.kv_caches = held

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate a zero KV cache of num_blocks blocks (and a fresh token history), before
        the first step is compiled: compiled steps are specific to one cache size."""
        if self.step_fns.items() or self.copy_fns.items():
            raise RuntimeError("initialize_kv_cache must come before any step is compiled")
        self.num_blocks = num_blocks
        self.reset_device_state()

    def persistent_bytes(self) -> int:
        """Per device: what every step reads and keeps (weights, KV cache, token history, the
        per-slot tables)."""
        return per_device_bytes((self.state, self.kv_caches, self.token_ids,
                                 self._slot_tables()))

    def step_memory(self) -> dict[tuple, StepMemory | None]:
        """Every step compiled so far: bucket key -> what it needs beyond persistent_bytes."""
        persistent = self.persistent_bytes()
        return {key: StepMemory.of(fn.memory_analysis(), persistent)
                for key, fn in self.step_fns.items()}

    # ---- one step ------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.fetch(self.dispatch(so))

    def dispatch(self, so: SchedulerOutput) -> PendingStep | None:
        """Apply the scheduler's diffs, pack the step and launch it; None if nothing runs."""
        self.input_batch.update_states(so)
        if so.is_empty:
            return None
        if so.blocks_to_copy:
            self._copy_blocks(so.blocks_to_copy)
        for new in so.scheduled_new_reqs:
            if new.num_computed_tokens:
                self._upload_history(self.input_batch.req_id_to_slot[new.req_id])
        host = self.input_batch.prepare(so, self.buckets)
        return PendingStep(host, self.run(host))

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source -> destination ids) in every layer, before the step."""
        src = np.zeros(self.max_num_seqs, np.int32)
        dst = np.zeros(self.max_num_seqs, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        self._count_h2d("block copies", src.nbytes + dst.nbytes)
        self.kv_caches = self.copy_fns.get(())(self.kv_caches, src, dst)

    def _upload_history(self, slot: int) -> None:
        """Copy the host's token row of `slot` into the device token history."""
        # A copy: the host row keeps changing while the (asynchronous) upload may still
        # read the buffer it was given.
        row = self.input_batch.token_ids[slot].copy()
        self._count_h2d("token history", row.nbytes + 4)
        self.token_ids = self.history_fns.get(())(self.token_ids, np.int32(slot), row)

    def _count_h2d(self, part: str, nbytes: int) -> None:
        self._h2d_before_step[part] = self._h2d_before_step.get(part, 0) + nbytes

    def run(self, host: HostStep) -> StepOutput:
        """Send the per-slot rows that changed, then launch the device step for a packed
        batch (asynchronously: returns futures)."""
        T, _, W = host.shape
        h2d, self._h2d_before_step = self._h2d_before_step, {}
        for name, rows in self.slot_rows.items():
            h2d[name] = rows.flush()
        # block_tables: gathered in the step from the device rows.
        md = AttentionMetadata(host.input_ids, host.positions, host.slot_mapping, None,
                               host.seq_lens, host.query_start_loc, host.num_seqs)
        bm = BatchMetadata(host.slot_T, host.from_device_T, host.logits_indices, host.slot_S,
                           host.samples_S, host.prompt_targets_T, host.wants_prompt_logprobs_T)
        h2d["step arguments"] = sum(a.nbytes for a in jax.tree.leaves((md, bm, host.sampling)))
        self.last_step_h2d = h2d
        self.total_h2d_bytes += sum(h2d.values())
        out, self.kv_caches, self.token_ids = self.step_fns.get((T, W))(
            self.state, self.kv_caches, self.token_ids, md, bm, host.sampling,
            self._slot_tables())
        out.sampled_token_ids.copy_to_host_async()
        return out

    def fetch(self, pending: PendingStep | None) -> ModelRunnerOutput:
        """Wait for a dispatched step's results and turn them into a ModelRunnerOutput."""
        if pending is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        host, out = pending.host, pending.out
        tokens_SP, num_S = np.asarray(out.sampled_token_ids)[:, None], None
        for feature in self.features:  # e.g. speculative verification's accepted runs
            record = host.feature_records.get(feature.name)
            if record is not None:
                tokens_SP, num_S = feature.sampled_tokens(record, out.features[feature.name],
                                                          tokens_SP, num_S)
        sampled = self.input_batch.record_sampled(host, tokens_SP, num_S)
        n = len(host.req_ids)
        want = host.sampling.num_logprobs[:n]
        logprobs = None
        if (want >= 0).any():
            tensors = jax.device_get(out.logprobs)
            logprobs = [logprobs_lists(tensors, [i], int(want[i]))
                        if want[i] >= 0 and sampled[i] else None for i in range(n)]
            for feature in self.features:  # e.g. one row per token of an accepted run
                record = host.feature_records.get(feature.name)
                if record is not None:
                    logprobs = feature.sampled_logprobs(record, out.features[feature.name],
                                                        logprobs, sampled)
        return ModelRunnerOutput(req_ids=host.req_ids, sampled_token_ids=sampled,
                                 logprobs=logprobs,
                                 prompt_logprobs=self._prompt_logprobs(host, out),
                                 activations=self._collect_features(host, out))

    def _collect_features(self, host: HostStep, out: StepOutput) -> dict:
        """req_id -> what a feature gives it from this step; a feature sees its (device)
        output only when the step's packing noted something to fetch, and copies what it
        needs."""
        collected = {}
        for feature in self.features:
            record = host.feature_records.get(feature.name)
            if record is not None:
                collected.update(feature.collect(record, out.features[feature.name]))
        return collected

    def _prompt_logprobs(self, host: HostStep, out: StepOutput
                         ) -> dict[str, tuple[int, LogprobsLists]]:
        """req_id -> (first prompt position scored, LogprobsLists) for requests that asked."""
        if not host.prompt_logprob_spans:
            return {}
        tensors = jax.device_get(out.prompt_logprobs)
        return {req_id: (first, logprobs_lists(tensors, slice(lo, hi), k))
                for req_id, (lo, hi, first, k) in host.prompt_logprob_spans.items()}


def _copy_blocks(kv_caches, src_C: jax.Array, dst_C: jax.Array):
    """kv_caches with block dst_C[i] := block src_C[i] in every layer (donated: in place).
    Destinations are distinct fresh blocks, or padding pairs (0, 0)."""
    return [(k.at[dst_C].set(k[src_C]), v.at[dst_C].set(v[src_C])) for k, v in kv_caches]


def _set_history_row(token_ids_RL: jax.Array, slot: jax.Array, row_L: jax.Array) -> jax.Array:
    """token_ids_RL [R, L] with row `slot` replaced by row_L [L] (donated: in place)."""
    return token_ids_RL.at[slot].set(row_L)
