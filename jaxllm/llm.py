"""LLM: vLLM's offline entry point. `LLM(model).generate(prompts, sampling_params)`.

A thin front end: prompt forms, chat templates and validation are the processor's
(`engine/processor.py`), the request life cycle is LLMEngine's. generate only adds requests
(all or nothing), loops over `step()`, and returns the finished outputs in input order; if a
step raises, the exception reaches the caller and nothing of the call stays queued.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxllm.beam_search import (BeamSearchOutput, BeamSearchParams, beam_search,
                                 beam_search_request_outputs)
from jaxllm.config import EngineConfig
from jaxllm.engine.processor import PromptInput, broadcast_params, parse_prompts
from jaxllm.llm_engine import LLMEngine
from jaxllm.outputs import RequestOutput
from jaxllm.pooling import offline as pooling
from jaxllm.pooling.config import runner_and_convert, wants_pooling_runner
from jaxllm.pooling.engine import PoolingEngine
from jaxllm.lora.manager import apply_lora_requests
from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None, *,
                 dtype: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 block_size: int = 16, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 num_gpu_blocks_override: int | None = None, enforce_eager: bool = False,
                 use_tqdm_on_load: bool = True, disable_log_stats: bool = True,
                 task: str | None = None, **kwargs: Any):
        # Pooling models (jaxllm/pooling/): vLLM's runner/convert, and task as their alias.
        kwargs["runner"], kwargs["convert"] = runner_and_convert(
            task, kwargs.get("runner", "auto"), kwargs.get("convert", "auto"))
        unknown = set(kwargs) - _CONFIG_FIELDS
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {sorted(unknown)}")
        config = EngineConfig(
            model=model, tokenizer=tokenizer, dtype=dtype, seed=seed,
            max_model_len=max_model_len, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override, enforce_eager=enforce_eager,
            disable_log_stats=disable_log_stats, **kwargs)
        if config.data_parallel_size > 1:
            # As in vLLM: one LLM drives one engine from the caller's thread.
            raise ValueError(f"LLM(...) runs one engine; data_parallel_size="
                             f"{config.data_parallel_size} is served by AsyncLLM and "
                             "`jaxllm serve --data-parallel-size N`")
        if wants_pooling_runner(config.model, config.runner, config.convert):
            self.runner_type = "pooling"
            self.llm_engine = PoolingEngine(config)
            return
        if config.pooler_config is not None:
            raise ValueError("pooler_config applies to pooling models; this one generates "
                             "(pass runner='pooling' or convert='embed' / 'classify')")
        self.runner_type = "generate"
        self.llm_engine = LLMEngine(config, use_tqdm=use_tqdm_on_load)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    def get_metrics(self):
        return self.llm_engine.get_metrics()

    def save_sharded_state(self, path: str) -> None:
        """Save the model's parameters as they are now, edits included, to the new directory
        `path` (orbax, each device its own shard, with the config and the tokenizer);
        `LLM(model=path)` and `jaxllm serve path` serve it. The state is the engine's own
        form: it is served with the same dtype, tensor_parallel_size and linear backend
        (the defaults pick them up from the directory; another value is a ValueError)."""
        self.llm_engine.save_sharded_state(path)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (engine/sleep.py): level 1 keeps the weights on the host and
        drops the KV cache; level 2 drops both (wake_up reads the checkpoint again)."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """-> whether fully awake (tags: "weights" and/or "kv_cache"; None: both)."""
        self.llm_engine.wake_up(tags)
        return not self.llm_engine.is_sleeping()

    # ---- generate ------------------------------------------------------------------------

    def generate(self, prompts=None, sampling_params=None, use_tqdm: bool = True, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 priority: int | Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a str, a {"prompt_token_ids": [...]} (or {"prompt": ...}) dict, or a list of
        those. The older keyword form `prompt_token_ids=[[...], ...]` is accepted too.
        priority: one int for every prompt, or one per prompt; lower is served first; needs
        scheduling_policy="priority" unless all are 0. lora_request: a LoRARequest for every
        prompt, or one per prompt (needs enable_lora=True)."""
        self._require("generate", "LLM.generate()")
        if isinstance(sampling_params, BeamSearchParams):
            if prompt_token_ids is not None or priority is not None:
                raise ValueError("beam search takes prompts only (no prompt_token_ids= or "
                                 "priority=)")
            return beam_search_request_outputs(self, prompts, sampling_params, lora_request)
        parsed = parse_prompts(prompts, prompt_token_ids)
        params = apply_lora_requests(broadcast_params(sampling_params, len(parsed)),
                                     lora_request)
        return self._run(parsed, params, use_tqdm, _priorities(priority, len(parsed)))

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request: LoRARequest | Sequence[LoRARequest] | None = None
                    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: one BeamSearchOutput per prompt, its beams best first
        (jaxllm/beam_search.py). Beams share KV blocks through the prefix cache."""
        self._require("generate", "LLM.beam_search()")
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        return beam_search(self, prompts, params, lora_request)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             priority: int | Sequence[int] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest] | None = None
             ) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them.
        tools: OpenAI's tool definitions, given to the chat template as `tools`. priority: as
        generate's, one int or one per conversation."""
        self._require("generate", "LLM.chat()")
        prompts = self.llm_engine.processor.render_chat(
            messages, chat_template, add_generation_prompt, continue_final_message,
            chat_template_kwargs, tools)
        params = apply_lora_requests(broadcast_params(sampling_params, len(prompts)),
                                     lora_request)
        return self._run(prompts, params, use_tqdm, _priorities(priority, len(prompts)))

    # ---- pooling (jaxllm/pooling/offline.py) ---------------------------------------------

    def _require(self, runner: str, what: str) -> None:
        """vLLM's refusal of a method the model's runner does not serve."""
        if self.runner_type == runner:
            return
        kind = "generative" if runner == "generate" else "pooling"
        raise ValueError(f"{what} is only supported for {kind} models. Try passing "
                         f"`--runner {runner}` to use the model as a {kind} model.")

    def encode(self, prompts, pooling_params=None, use_tqdm: bool = True, *,
               pooling_task: str | None = None):
        """-> list[PoolingRequestOutput] for each prompt (str, token ids, or lists of them, as
        generate takes): its pooled row, or for "token_embed" / "token_classify" one row per
        token. pooling_task is required, as in vLLM."""
        self._require("pooling", "LLM.encode()")
        return pooling.encode(self.llm_engine, prompts, pooling_params, pooling_task, use_tqdm)

    def embed(self, prompts, *, pooling_params=None, use_tqdm: bool = True):
        """-> list[EmbeddingRequestOutput], in input order."""
        self._require("pooling", "LLM.embed()")
        return pooling.embed(self.llm_engine, prompts, pooling_params, use_tqdm)

    def classify(self, prompts, *, pooling_params=None, use_tqdm: bool = True):
        """-> list[ClassificationRequestOutput] (probabilities, unless use_activation=False)."""
        self._require("pooling", "LLM.classify()")
        return pooling.classify(self.llm_engine, prompts, pooling_params, use_tqdm)

    def score(self, data_1, data_2, /, *, pooling_params=None, use_tqdm: bool = True):
        """-> list[ScoringRequestOutput] for the pairs 1:1, 1:N or N:N: a cross-encoder's
        score of each text pair, or an embedding model's cosine similarity."""
        self._require("pooling", "LLM.score()")
        return pooling.score(self.llm_engine, data_1, data_2, pooling_params, use_tqdm)

    def _run(self, prompts: list[PromptInput], params: list[SamplingParams],
             use_tqdm: bool, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        engine = self.llm_engine
        # All or nothing; one output per request, at its end (vLLM's offline behaviour).
        order = engine.add_requests(prompts, params, output_kind=RequestOutputKind.FINAL_ONLY,
                                    priorities=priority)
        try:
            return self._run_engine(order, use_tqdm)
        except BaseException:
            # The caller gets the exception, so nothing of this call may stay queued (a failed
            # step's own requests are already finished; this drops the rest).
            engine.discard_requests(order)
            raise

    def _run_engine(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(order)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm, postfix="est. speed input: 0.00 toks/s, "
                                                 "output: 0.00 toks/s")
        in_toks = out_toks = 0
        while len(done) < len(order):
            for out in engine.step():
                if out.request_id not in wanted or not out.finished:
                    continue
                done[out.request_id] = out
                in_toks += len(out.prompt_token_ids)
                out_toks += sum(len(c.token_ids) for c in out.outputs)
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.postfix = (f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                               f"output: {out_toks / elapsed:.2f} toks/s")
                bar.update(1)
        bar.close()
        return [done[rid] for rid in order]


def _priorities(priority, num_prompts: int) -> list[int] | None:
    """vLLM's rule: None (all 0), one int for every prompt, or a sequence of one per prompt.
    Each is checked to be an int at admission (the processor's check_priority)."""
    if priority is None:
        return None
    if isinstance(priority, numbers.Integral) and not isinstance(priority, bool):
        return [int(priority)] * num_prompts
    if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
        raise ValueError("priority must be an int or a list of ints (one per prompt), got "
                         f"{type(priority).__name__}")
    if len(priority) != num_prompts:
        raise ValueError(f"The lengths of prompts ({num_prompts}) and priority "
                         f"({len(priority)}) must be the same.")
    return list(priority)
