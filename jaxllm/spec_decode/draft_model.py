"""Draft-model proposals (vLLM's method "draft_model"): a second causal LM, sharing the
target's tokenizer, proposes each row's next k tokens greedily.

Owns the draft engine (a nested LLMEngine over the draft checkpoint in this process: its
own weights, its own paged KV cache and block manager, prefix caching on) and one batched
proposal per step. At `begin_step` every row that may verify drafts this step enters the
draft engine as a request: its whole history as the prompt, k greedy tokens (EOS ignored).
The prefix cache holds the history's full blocks from the row's last proposal, so the draft
recomputes only the partial last block and the tokens accepted since (one prefill-like
step), then decodes k - 1 steps, all rows batched. Rejected drafts need no rollback here:
the next proposal's prompt is the verified history, and blocks past it are never hit.

Greedy proposals are exact for every sampling kind: the verifier treats a draft as a
one-hot proposal q (as n-gram's), so accepting with probability p(d) and resampling from
norm(max(0, p - q)) keeps the target's distribution (spec_decode/rejection.py).
Never touches the target's cache, requests or step; never samples but greedily.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np

from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class DraftModelProposer:
    proposes_ahead = True  # begin_step runs the draft for the step's rows

    def __init__(self, engine, num_speculative_tokens: int):
        self.engine = engine
        self.k = num_speculative_tokens
        self._ahead: dict[str, np.ndarray] = {}  # req_id -> this step's drafts
        self._num_proposals = 0

    @classmethod
    def create(cls, spec_config, target_config, target_vocab_size: int, dtype_name: str,
               num_blocks: int) -> "DraftModelProposer":
        """The draft engine: the target's engine options (max_model_len, buckets, backends,
        tensor parallelism) in the target's dtype, with as many KV blocks as the target (it
        holds the same sequences), synchronous, no stats line."""
        from jaxllm.config import EngineConfig
        from jaxllm.llm_engine import LLMEngine

        c = target_config
        config = EngineConfig(
            model=spec_config.model, dtype=dtype_name, seed=c.seed,
            max_model_len=c.max_model_len, block_size=c.block_size,
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            num_gpu_blocks_override=num_blocks, enforce_eager=c.enforce_eager,
            attention_backend=c.attention_backend, linear_backend=c.linear_backend,
            compilation_cache_dir=c.compilation_cache_dir, max_logprobs=0,
            tensor_parallel_size=c.tensor_parallel_size, async_scheduling=False,
            enable_prefix_caching=True, disable_log_stats=True)
        engine = LLMEngine(config, use_tqdm=False)
        draft_vocab = engine.model_config.vocab_size
        if draft_vocab != target_vocab_size:
            raise ValueError(
                f"speculative_config model {spec_config.model!r} has a vocabulary of "
                f"{draft_vocab} tokens, the target {target_vocab_size}: a draft model must "
                f"share the target's tokenizer and vocabulary")
        logger.info("draft model %s loaded for speculative decoding (k=%d)",
                    spec_config.model, spec_config.num_speculative_tokens)
        return cls(engine, spec_config.num_speculative_tokens)

    def begin_step(self, requests) -> None:
        """Propose for every row of `requests` (those that may verify drafts this step) in
        one batched run of the draft engine."""
        self._ahead.clear()
        if not requests:
            return
        params = SamplingParams(temperature=0.0, max_tokens=self.k, ignore_eos=True,
                                detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        ids = {}
        for request in requests:
            self._num_proposals += 1
            draft_id = f"draft-{self._num_proposals}"
            ids[draft_id] = request.request_id
            self.engine.add_request(None, request.all_token_ids, params, request_id=draft_id)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    self._ahead[ids[out.request_id]] = np.asarray(out.outputs[0].token_ids,
                                                                  np.int32)

    def propose_for(self, request, k: int) -> np.ndarray:
        """This step's drafts of `request` (int32, length 0..k); none if it was not among
        begin_step's rows."""
        return self._ahead.pop(request.request_id, np.empty(0, np.int32))[:k]

    def shutdown(self) -> None:
        self.engine.shutdown()


def draft_proposer(config, target_vocab_size: int, dtype, num_blocks: int):
    """The engine's draft-model proposer, or None (no speculation, or n-gram)."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    return DraftModelProposer.create(spec, config, target_vocab_size, jnp.dtype(dtype).name,
                                     num_blocks)
