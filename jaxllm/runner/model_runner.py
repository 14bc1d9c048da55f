"""The runner: SchedulerOutput in, ModelRunnerOutput out, one jitted step in between.

Owns the device state (parameters split once, the KV cache, donated on every step), the
compiled executables per bucket, and the per-request host state it rebuilt from scheduler
messages. Never sees a scheduler `Request`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxllm.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from jaxllm.models.base import AttentionMetadata
from jaxllm.models.llama import init_kv_caches
from jaxllm.models.sharding import kv_cache_sharding
from jaxllm.runner.buckets import BucketConfig
from jaxllm.runner.input_batch import (CachedRequestState, StepInputs, prepare_inputs,
                                       update_states)
from jaxllm.runner.sampler import logprobs_lists, prompt_logprobs_jit, sample_jit
from jaxllm.runner.sampling_metadata import (SamplingRow, build_sampling_metadata,
                                             dummy_sampling_metadata, sampler_variants)
from jaxllm.runner.step import (CompiledFunctions, abstract_metadata, make_prompt_logits_fn,
                                make_step_fn)


class ModelRunner:
    def __init__(self, model, *, num_blocks: int, block_size: int, kv_dtype, buckets: BucketConfig,
                 attention_backend: str, max_model_len: int, eos_token_ids: tuple[int, ...],
                 mesh=None):
        cfg = model.config
        self.block_size = block_size
        self.buckets = buckets
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.graphdef, self.state = nnx.split(model)
        # Tensor parallelism: caches split over KV heads when they divide evenly; host inputs
        # and every output the host reads are replicated over the mesh.
        rep = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        kv_sharding = (kv_cache_sharding(mesh) if mesh is not None
                       and cfg.num_key_value_heads % mesh.size == 0 else rep)
        self.kv_caches = init_kv_caches(cfg, num_blocks, block_size, kv_dtype, kv_sharding)
        self.requests: dict[str, CachedRequestState] = {}

        V = cfg.vocab_size
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32, sharding=rep)  # noqa
        self.step_fns = CompiledFunctions(
            make_step_fn(self.graphdef, attention_backend, rep),
            lambda T, S, W: (self.state, self.kv_caches, *abstract_metadata(T, S, W, rep)))
        self.sample_fns = CompiledFunctions(
            sample_jit,
            lambda S, variant: (f32(S, V), dummy_sampling_metadata(
                S, variant, max_model_len=max_model_len)))
        self.prompt_logits_fns = CompiledFunctions(
            make_prompt_logits_fn(self.graphdef),
            lambda T: (self.state, jax.ShapeDtypeStruct((T, cfg.hidden_size), self._hidden_dtype(),
                                                        sharding=rep)))
        self.prompt_logprobs_fns = CompiledFunctions(
            prompt_logprobs_jit,
            lambda T: (f32(T, V), jax.ShapeDtypeStruct((T,), np.int32, sharding=rep)))

    def _hidden_dtype(self):
        return jax.tree.leaves(self.state)[0].dtype

    @property
    def num_compiles(self) -> int:
        return sum(f.num_compiles for f in (self.step_fns, self.sample_fns,
                                            self.prompt_logits_fns, self.prompt_logprobs_fns))

    def warmup(self, use_tqdm: bool = True) -> None:
        """Compile every bucket the engine can launch, so serving never compiles."""
        work = [(self.step_fns, shape) for shape in self.buckets.all_shapes()]
        seq_buckets = sorted({S for _, S, _ in self.buckets.all_shapes()})
        work += [(self.sample_fns, (S, v)) for S in seq_buckets for v in sampler_variants()]
        work += [(f, (T,)) for T in self.buckets.token_buckets
                 for f in (self.prompt_logits_fns, self.prompt_logprobs_fns)]
        # XLA compiles without the GIL: one thread per core roughly divides the wall time.
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            futures = [pool.submit(fns.get, key) for fns, key in work]
            for f in tqdm(as_completed(futures), total=len(futures), desc="Compiling buckets",
                          disable=not use_tqdm):
                f.result()

    # ---- one step ------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        update_states(self.requests, so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inp = prepare_inputs(self.requests, so, self.buckets, self.block_size)
        T, S, W = inp.shape
        md = AttentionMetadata(inp.input_ids, inp.positions, inp.slot_mapping, inp.block_tables,
                               inp.seq_lens, inp.query_start_loc, inp.num_seqs)
        logits_SV, hidden_TD, self.kv_caches = self.step_fns.get((T, S, W))(
            self.state, self.kv_caches, md, inp.logits_indices)

        states = [self.requests[r] for r in inp.req_ids]
        rows = [SamplingRow(st.sampling_params, st.sampling_params.seed, st.prompt_token_ids,
                            st.output_token_ids) for st in states]
        smd = build_sampling_metadata(rows, num_seqs_padded=S, eos_token_ids=self.eos_token_ids,
                                      max_model_len=self.max_model_len)
        out = self.sample_fns.get((S, smd.variant))(logits_SV, smd)
        sampled = np.asarray(out.sampled_token_ids)
        logprob_tensors = jax.device_get(out.logprobs) if out.logprobs is not None else None

        sampled_token_ids, logprobs = [], []
        for i, st in enumerate(states):
            want = st.sampling_params.logprobs
            if not inp.samples[i]:  # a prefill chunk that ends mid-prompt samples nothing
                sampled_token_ids.append([])
                logprobs.append(None)
                continue
            token = int(sampled[i])
            st.output_token_ids.append(token)
            sampled_token_ids.append([token])
            logprobs.append(logprobs_lists(logprob_tensors, [i], want)
                            if want is not None else None)
        return ModelRunnerOutput(
            req_ids=inp.req_ids, sampled_token_ids=sampled_token_ids,
            logprobs=logprobs if logprob_tensors is not None else None,
            prompt_logprobs=self._prompt_logprobs(inp, states, hidden_TD))

    def _prompt_logprobs(self, inp: StepInputs, states, hidden_TD) -> dict:
        """req_id -> (first prompt position scored, LogprobsLists) for requests that asked.

        Row p of a request scores prompt token p + 1, so a chunk at positions start..stop-1
        yields prompt logprobs for tokens start+1..stop (the last prompt token has no row:
        the position after it predicts the first output)."""
        wanted = [i for i, st in enumerate(states)
                  if st.sampling_params.prompt_logprobs is not None
                  and inp.positions[inp.query_start_loc[i]] + 1 < len(st.prompt_token_ids)]
        if not wanted:
            return {}
        T = inp.shape[0]
        targets = np.zeros(T, np.int32)
        spans = {}
        for i in wanted:
            st = states[i]
            lo, hi = int(inp.query_start_loc[i]), int(inp.query_start_loc[i + 1])
            start = int(inp.positions[lo])
            stop = min(start + (hi - lo), len(st.prompt_token_ids) - 1)
            targets[lo:lo + stop - start] = st.prompt_token_ids[start + 1:stop + 1]
            spans[i] = (lo, lo + stop - start, start + 1)
        logits_TV = self.prompt_logits_fns.get((T,))(self.state, hidden_TD)
        tensors = jax.device_get(self.prompt_logprobs_fns.get((T,))(logits_TV, targets))
        return {states[i].req_id: (first, logprobs_lists(tensors, slice(lo, hi),
                                                         states[i].sampling_params.prompt_logprobs))
                for i, (lo, hi, first) in spans.items()}
