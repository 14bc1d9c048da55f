"""LLM: vLLM's offline entry point. `LLM(model).generate(prompts, sampling_params)`.

Owns argument handling (prompt forms, one-or-many sampling params, chat templates) and the
progress bar. Everything else is LLMEngine's: generate only adds requests, loops over
`step()`, and returns the finished outputs in input order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxllm.config import EngineConfig
from jaxllm.llm_engine import LLMEngine
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None, *,
                 dtype: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 block_size: int = 16, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 num_gpu_blocks_override: int | None = None, enforce_eager: bool = False,
                 use_tqdm_on_load: bool = True, **kwargs: Any):
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
            **kwargs)
        self.llm_engine = LLMEngine(config, use_tqdm=use_tqdm_on_load)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    def get_metrics(self):
        return self.llm_engine.get_metrics()

    # ---- generate ------------------------------------------------------------------------

    def generate(self, prompts=None, sampling_params=None, use_tqdm: bool = True, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a str, a {"prompt_token_ids": [...]} (or {"prompt": ...}) dict, or a list of
        those. The older keyword form `prompt_token_ids=[[...], ...]` is accepted too."""
        parsed = _parse_prompts(prompts, prompt_token_ids)
        params = _broadcast_params(sampling_params, len(parsed))
        return self._run(parsed, params, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, chat_template=chat_template, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message)
            # The template already holds any BOS; tokenizing must not add a second one.
            ids = tok(text, add_special_tokens=False)["input_ids"]
            prompts.append((text, ids))
        return self._run(prompts, _broadcast_params(sampling_params, len(prompts)), use_tqdm)

    def _run(self, prompts: list[tuple[str | None, list[int] | None]],
             params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        tok = self.get_tokenizer()
        requests = []
        for text, ids in prompts:  # tokenize and validate everything before adding anything
            ids = tok(text)["input_ids"] if ids is None else list(ids)
            requests.append((text, ids))
        for (_, ids), p in zip(requests, params):
            engine.validate(ids, p)
        order = [engine.add_request(text, ids, p) for (text, ids), p in zip(requests, params)]
        return self._run_engine(order, use_tqdm)

    def _run_engine(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm, postfix="est. speed input: 0.00 toks/s, "
                                                 "output: 0.00 toks/s")
        in_toks = out_toks = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
                in_toks += len(out.prompt_token_ids)
                out_toks += sum(len(c.token_ids) for c in out.outputs)
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.postfix = (f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                               f"output: {out_toks / elapsed:.2f} toks/s")
                bar.update(1)
        bar.close()
        return [done[rid] for rid in order]


def _parse_prompts(prompts, prompt_token_ids) -> list[tuple[str | None, list[int] | None]]:
    if prompts is None and prompt_token_ids is None:
        raise ValueError("Either prompts or prompt_token_ids must be provided")
    if prompts is None:
        return [(None, list(ids)) for ids in prompt_token_ids]
    if prompt_token_ids is not None:
        raise ValueError("Pass either prompts or prompt_token_ids, not both")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, None))
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            out.append((p.get("prompt"), list(p["prompt_token_ids"])))
        elif isinstance(p, dict) and "prompt" in p:
            out.append((p["prompt"], None))
        else:
            raise ValueError("each prompt must be a str, or a dict with 'prompt' or "
                             f"'prompt_token_ids'; got {type(p).__name__}")
    return out


def _broadcast_params(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    sampling_params = list(sampling_params)
    if len(sampling_params) != num_prompts:
        raise ValueError(f"The lengths of prompts ({num_prompts}) and sampling_params "
                         f"({len(sampling_params)}) must be the same.")
    return sampling_params
