"""What is jitted, and with which static shapes: one program per token bucket T.

Owns the jitted step (model forward, logits of each sequence's last row, sampling, and prompt
logprobs when some row asks) and the device inputs it reads beside the attention metadata.
One step is one dispatch: the sampler runs inside it, its `lax.cond`s skip what no row
needs, so a bucket never compiles twice. The KV cache and the token history are donated and
updated in place. Functions are jitted once over (graphdef, state): `nnx.split` happens once
at load, `nnx.merge` inside. Every compile goes through `CompiledFunctions`, which counts
them: serving after warm-up must count zero.

The token history `token_ids_RL` [R slots, L = max_model_len] holds, for the request in each
slot, every token that went into a step or came out of one. It is what lets the host schedule
step N+1 before step N's sample reaches it (async scheduling): a row whose token the host
does not know yet (`from_device_T`) reads it here. The penalties read it too.

    step N   samples o7 for slot 3       -> token_ids_RL[3, 7] = o7
    step N+1 row t: slot 3, position 7   -> input_ids[t] = token_ids_RL[3, 7]   (host sent 0)

The runner's step also reads the persistent batch's per-slot tables on the device (`rows`:
block tables [R + 1, W_max], bad words, allowed-token bits; runner/device_rows.py) and
gathers the rows of this step's sequences itself (`with_slot_rows`), so the host sends
neither the [S, W] block tables nor the sampling tables. They are only read, never donated.
The step features' tables are among them; the features themselves act at the forward's
named points through `StepHooks` and may add outputs (`StepOutput.features`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.models.base import AttentionMetadata
from jaxllm.models.hooks import StepHooks
from jaxllm.models.parallel import ParallelOps
from jaxllm.runner.sampler import (LogprobsTensors, chunked_prompt_logprobs, num_topk,
                                   prompt_logprobs_chunk_rows, sample, zero_logprobs)
from jaxllm.runner.sampling_metadata import SamplingMetadata, dummy_sampling_metadata
from jaxllm.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from jaxllm.runner.step_features import StepFeature


@flax.struct.dataclass
class BatchMetadata:
    """Per-step device inputs of the runner beyond attention (T rows, S sequences)."""

    slot_T: jax.Array  # [T] int32, batch slot of each row; R (out of range) for padding rows
    from_device_T: jax.Array  # [T] bool, the row's token is only in token_ids_RL
    logits_indices_S: jax.Array  # [S] int32, last packed row of each sequence
    slot_S: jax.Array  # [S] int32, batch slot of each sequence; R for padding
    samples_S: jax.Array  # [S] bool, the sequence samples this step (its chunk reaches the end)
    prompt_targets_T: jax.Array  # [T] int32, the prompt token each row predicts (or 0)
    wants_prompt_logprobs_T: jax.Array  # [T] bool, rows whose prompt logprob is wanted


@dataclasses.dataclass(frozen=True)
class SampledStep:
    """What the features see at the "sampled" point (trace time; T rows, S sequences)."""

    hidden_TD: jax.Array  # the final hidden states of every packed row
    input_ids_T: jax.Array  # the row tokens, device-fed ones filled in
    logits_fn: Callable[[jax.Array], jax.Array]  # hidden [N, D] -> f32 logits [N, V]
    # f32 [T, V], the raw logits of every packed row where the step computed them anyway
    # (`step_logits`); None: rows other than the sampled ones need logits_fn
    logits_TV: jax.Array | None
    bm: BatchMetadata
    smd: SamplingMetadata
    sampled_S: jax.Array  # [S] int32, the sampler's token at each sequence's last row


@flax.struct.dataclass
class StepOutput:
    sampled_token_ids: jax.Array  # [S] int32 (garbage for rows that do not sample)
    logprobs: LogprobsTensors  # [S] rows; zeros unless some row asked
    prompt_logprobs: LogprobsTensors  # [T] rows; zeros unless some row asked
    # feature name -> its extra output (runner/step_features.py), e.g. "capture": [T, K, D]
    features: dict[str, Any] = flax.struct.field(default_factory=dict)


def make_step_fn(graphdef, ops: ParallelOps, *, logprobs_mode: str = "raw_logprobs",
                 max_logprobs: int = MAX_LOGPROBS, prompt_logprobs_chunk: int | None = None,
                 features: tuple[StepFeature, ...] = ()):
    """`ops`: what runs per shard (models/parallel.py); the logits it returns are whole rows
    on every device, so sampling needs no collective. logprobs_mode and max_logprobs (the
    top-k width of every logprobs output) are engine statics. prompt_logprobs_chunk: prompt
    rows whose logits are computed at once (None: as many as fit
    sampler.PROMPT_LOGPROBS_CHUNK_BYTES). features: the engine's step features
    (runner/step_features.py), at the forward's named points; their per-slot tables are
    among `rows`."""

    def step(state, kv_caches, token_ids_RL, md: AttentionMetadata, bm: BatchMetadata,
             smd: SamplingMetadata, rows: dict[str, jax.Array] | None = None,
             width: int | None = None):
        if rows is not None:
            md, smd = with_slot_rows(md, smd, rows, bm.slot_S, width)
        model = nnx.merge(graphdef, state)
        R = token_ids_RL.shape[0]
        known_T = token_ids_RL.at[bm.slot_T, md.positions].get(mode="fill", fill_value=0)
        input_ids_T = jnp.where(bm.from_device_T, known_T, md.input_ids)
        token_ids_RL = token_ids_RL.at[bm.slot_T, md.positions].set(input_ids_T, mode="drop")
        hooks = StepHooks(features, rows, bm.slot_T, bm.slot_S).bind(model)
        hidden_TD, kv_caches = model(md.replace(input_ids=input_ids_T), kv_caches,
                                     dataclasses.replace(ops, hooks=hooks), hooks)
        logits_fn = lambda h_ND: model.compute_logits(h_ND, ops)  # noqa: E731  (f32)
        logits_TV, logits_SV = step_logits(logits_fn, hidden_TD, bm.logits_indices_S,
                                           features)
        logits_SV = hooks.at("logits", None, logits_SV)  # e.g. grammar bitmasks

        k = num_topk(max_logprobs, logits_SV.shape[-1])
        out = sample(logits_SV, smd,
                     lambda: token_ids_RL.at[bm.slot_S].get(mode="fill", fill_value=0),
                     logprobs_mode=logprobs_mode, max_num_logprobs=max_logprobs)
        # The sampled token sits right after the sequence's last computed position.
        hooks.sampled(SampledStep(hidden_TD, input_ids_T, logits_fn, logits_TV, bm, smd,
                                  out.sampled_token_ids))
        write_slot_S = jnp.where(bm.samples_S, bm.slot_S, R)
        token_ids_RL = token_ids_RL.at[write_slot_S, md.seq_lens].set(out.sampled_token_ids,
                                                                      mode="drop")

        def prompt_logprobs():
            rows = prompt_logprobs_chunk or prompt_logprobs_chunk_rows(logits_SV.shape[-1])
            return chunked_prompt_logprobs(logits_fn, hidden_TD, bm.prompt_targets_T, k, rows)

        prompt = jax.lax.cond(jnp.any(bm.wants_prompt_logprobs_T), prompt_logprobs,
                              lambda: zero_logprobs(bm.prompt_targets_T, k))
        return (StepOutput(out.sampled_token_ids, out.logprobs, prompt, hooks.outputs()),
                kv_caches, token_ids_RL)

    return jax.jit(step, donate_argnums=(1, 2), static_argnums=7)


def step_logits(logits_fn: Callable[[jax.Array], jax.Array], hidden_TD: jax.Array,
                logits_indices_S: jax.Array, features: tuple[StepFeature, ...] = ()
                ) -> tuple[jax.Array | None, jax.Array]:
    """-> (logits_TV or None, logits_SV): the LM head over the rows the step needs, once.

    The sampler needs the S sampled rows. A feature that reads other rows' logits
    (`StepFeature.reads_row_logits`: speculative verification, at the rows before each
    sequence's last) would run the LM head a second time; in a bucket where S == T (every
    bucket up to max_num_seqs) the LM head over all T rows costs what the S sampled rows'
    does, so it runs once there and the sampled rows are a gather of it:

        T == S, a feature reads rows:   logits_TV = head(hidden_TD)   logits_SV = its rows
        otherwise:                      None                          head(hidden_TD[rows])

    (The product has the same [S, D] x [D, V] shape either way, and a GEMM computes each
    row alone, so the sampled rows' logits are the same either way.)"""
    T, S = hidden_TD.shape[0], logits_indices_S.shape[0]
    if T == S and any(f.reads_row_logits for f in features):
        logits_TV = logits_fn(hidden_TD)
        return logits_TV, logits_TV[logits_indices_S]
    return None, logits_fn(hidden_TD[logits_indices_S])


def with_slot_rows(md: AttentionMetadata, smd: SamplingMetadata, rows: dict[str, jax.Array],
                   slot_S: jax.Array, width: int) -> tuple[AttentionMetadata, SamplingMetadata]:
    """Fill the step inputs that the persistent batch keeps on the device
    (runner/device_rows.py): each table [R + 1, ...] is gathered by the sequences' slots, and
    padding sequences (slot R) read row R, the fill row. `width`: the block-table width
    bucket W (static). A per-slot table of a new feature adds its line here."""
    return (md.replace(block_tables=rows["block_tables"][slot_S, :width]),
            smd.replace(bad_words=rows["bad_words"][slot_S],
                        allowed_token_bits=rows["allowed_token_bits"][slot_S]))


def abstract_slot_row_inputs(T: int, S: int, W: int, rows: dict[str, jax.Array], sharding=None
                             ) -> tuple:
    """(md, bm, smd, rows, W) of a (T, S, W) step whose per-slot rows are the device tables
    `rows` (the tail of the step's arguments after the token history), each with its own
    sharding (most are replicated; runner/device_rows.py)."""
    md, bm, smd = abstract_inputs(T, S, W, sharding)
    # each table as it is placed (most replicated; runner/device_rows.py)
    sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)  # noqa: E731
    return (md.replace(block_tables=None), bm,
            smd.replace(bad_words=None, allowed_token_bits=None),
            {name: sds(table) for name, table in rows.items()}, W)


def abstract_inputs(T: int, S: int, W: int, sharding=None, vocab_size: int = 0
                    ) -> tuple[AttentionMetadata, BatchMetadata, SamplingMetadata]:
    """ShapeDtypeStructs of a (T, S, W) step's metadata, for ahead-of-time compiles.
    vocab_size: the width of the allowed-token bit sets (0: no row may restrict)."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)  # noqa
    bool_ = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=sharding)  # noqa
    md = AttentionMetadata(input_ids=i32(T), positions=i32(T), slot_mapping=i32(T),
                           block_tables=i32(S, W), seq_lens=i32(S), query_start_loc=i32(S + 1),
                           num_seqs=i32())
    bm = BatchMetadata(slot_T=i32(T), from_device_T=bool_(T), logits_indices_S=i32(S),
                       slot_S=i32(S), samples_S=bool_(S), prompt_targets_T=i32(T),
                       wants_prompt_logprobs_T=bool_(T))
    smd = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                       dummy_sampling_metadata(S, vocab_size=vocab_size))
    return md, bm, smd


class CompiledFunctions:
    """AOT-compiled executables keyed by their static shape; compiles on a miss and counts.
    `on_compile(key, executable)`, when set, sees every executable compiled from then on."""

    def __init__(self, jitted, abstract_args: Callable[..., tuple]):
        self._jitted = jitted
        self._abstract_args = abstract_args
        self._compiled: dict[tuple, object] = {}
        self._lock = threading.Lock()  # warm-up compiles from several threads
        self.num_compiles = 0
        self.on_compile: Callable[[tuple, object], None] | None = None

    def memory_analysis(self, key: tuple):
        """XLA's memory analysis of the executable for `key`, compiled now from the current
        abstract arguments and not kept (a profile; None where the platform has none)."""
        return self._jitted.lower(*self._abstract_args(*key)).compile().memory_analysis()

    def items(self) -> list[tuple[tuple, object]]:
        """(key, compiled executable) of everything compiled so far."""
        with self._lock:
            return list(self._compiled.items())

    def get(self, key: tuple):
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._jitted.lower(*self._abstract_args(*key)).compile()
            with self._lock:
                self._compiled[key] = fn
                self.num_compiles += 1
            if self.on_compile is not None:
                self.on_compile(key, fn)
        return fn
