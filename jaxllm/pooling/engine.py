"""PoolingEngine: the pooling runner's engine, beside LLMEngine (never a branch inside it).

Owns the wiring (checkpoint -> pooling model, tokenizer, PoolingScheduler, PoolingRunner),
tokenizing prompts and text pairs with the limits of max_model_len, and the step loop:
schedule, execute, finish each request's row. Requests are checked whole before any is added
(all or nothing). Never samples and never allocates a KV cache.

Limits, as vLLM sets them for pooling models: chunked prefill is off (a prompt runs in one
step), so max_num_batched_tokens is at least max_model_len; max_model_len is the smaller of
the model's positions and sentence-transformers' `max_seq_length`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxllm.config import EngineConfig
from jaxllm.engine.processor import PromptInput
from jaxllm.kernels.linear_methods import select_linear_method
from jaxllm.models.dtype import DTYPES
from jaxllm.models.resolve import DEFAULT_POOLING_MODEL, resolve_model
from jaxllm.models.weights import iter_hf_dir_tensors, load_params, read_json
from jaxllm.pooling.attention import Tiling
from jaxllm.pooling.config import read_pooling_model
from jaxllm.pooling.outputs import PoolingOutput, PoolingRequestOutput
from jaxllm.pooling.params import PoolingParams
from jaxllm.pooling.poolers import check_params, finish, make_rows
from jaxllm.pooling.runner import PoolingInput, PoolingRunner
from jaxllm.pooling.scheduler import PoolingRequest, PoolingScheduler
from jaxllm.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TextPair:
    """A cross-encoder's input: two texts tokenized as one pair (BERT: token types 0 and 1)."""

    text: str
    text_pair: str


class PoolingEngine:
    runner_type = "pooling"

    def __init__(self, config: EngineConfig):
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
            if getattr(config, name) != 1:
                raise ValueError(f"{name}={getattr(config, name)}: pooling models run on one "
                                 f"device; {name} must be 1")
        resolved = resolve_model(config.model or DEFAULT_POOLING_MODEL)
        if resolved.kind != "hf_dir":
            raise ValueError(f"pooling models load from Hugging Face directories; "
                             f"{resolved.name!r} is a {resolved.kind}")
        hf = read_json(os.path.join(resolved.path, "config.json"))
        mcfg, self.pooler_config = read_pooling_model(resolved.path, hf, config.convert,
                                                      config.pooler_config)
        id2label = hf.get("id2label") if isinstance(hf.get("id2label"), dict) else {}
        self.labels = {int(k): str(v) for k, v in id2label.items() if str(k).isdigit()}
        # "auto" is float32 on the CPU: an encoder's step is small, and parity is exact.
        dtype = (jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32) \
            if config.dtype == "auto" else DTYPES[config.dtype]
        self.model = load_params(mcfg, iter_hf_dir_tensors(resolved.path), dtype)
        self.model_config, self.resolved_model, self.dtype = mcfg, resolved, dtype
        self.tokenizer = get_tokenizer(config.tokenizer or resolved.path)
        self.uses_token_types = mcfg.type_vocab_size > 0
        self.config = config = self._limits(config, resolved.path, mcfg)
        self.scheduler = PoolingScheduler(config.max_num_batched_tokens, config.max_num_seqs,
                                          Tiling.for_max_model_len(config.max_model_len))
        self.runner = PoolingRunner(
            self.model, make_rows(self.pooler_config),
            causal=not getattr(self.model, "bidirectional", False),
            linear_method=select_linear_method(config.linear_backend, dtype),
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs, enforce_eager=config.enforce_eager)
        self._ids = itertools.count()

    @staticmethod
    def _limits(config: EngineConfig, path: str, mcfg) -> EngineConfig:
        model_max = mcfg.max_position_embeddings
        st_path = os.path.join(path, "sentence_bert_config.json")
        if os.path.isfile(st_path):
            model_max = min(model_max, read_json(st_path).get("max_seq_length") or model_max)
        if config.max_model_len and config.max_model_len > model_max:
            raise ValueError(f"max_model_len ({config.max_model_len}) is greater than the "
                             f"model's maximum length ({model_max}); choose max_model_len <= "
                             f"{model_max}")
        max_model_len = config.max_model_len or model_max
        if config.max_num_batched_tokens and config.max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must "
                             f"be >= max_model_len ({max_model_len}) for a pooling model: "
                             f"a prompt is never split over steps")
        resolved = config.resolved(max_model_len, jax.default_backend() != "cpu")
        return dataclasses.replace(resolved, max_num_batched_tokens=max(
            resolved.max_num_batched_tokens, max_model_len), enable_prefix_caching=False)

    # ---- requests ----------------------------------------------------------------------

    def _truncation(self, params: PoolingParams) -> int | None:
        k = params.truncate_prompt_tokens
        return self.config.max_model_len if k == -1 else k

    @staticmethod
    def _tokenizer_kwargs(k: int | None) -> dict:
        return dict(truncation=True, max_length=k) if k is not None else {}

    def _encode_texts(self, prompts: list, params: list[PoolingParams]) -> dict[int, dict]:
        """The tokenizer's output for each plain-text prompt, by index: texts with the same
        truncation go to the tokenizer as one batch (the fast tokenizer encodes a batch in
        parallel; one call per prompt took 1.5-2.4x as long on 1,000 sentences)."""
        groups: dict[int | None, list[int]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(prompt, TextPair) and prompt.token_ids is None:
                groups.setdefault(self._truncation(p), []).append(i)
        out = {}
        for k, idx in groups.items():
            enc = self.tokenizer([prompts[i].text for i in idx], **self._tokenizer_kwargs(k))
            for j, i in enumerate(idx):
                out[i] = {name: enc[name][j] for name in enc.keys()}
        return out

    def tokenize(self, prompt: PromptInput | TextPair, params: PoolingParams,
                 encoded: dict | None = None) -> tuple[list[int], list[int] | None]:
        """-> (token ids, token types or None), truncated as `params` asks, else checked.
        `encoded`: the tokenizer's output for this prompt's text, if already run."""
        max_len = self.config.max_model_len
        k = self._truncation(params)
        if k is not None and k > max_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) must be <= max_model_len "
                             f"({max_len})")
        if isinstance(prompt, TextPair) or prompt.token_ids is None:
            texts = ((prompt.text, prompt.text_pair) if isinstance(prompt, TextPair)
                     else (prompt.text,))
            enc = (encoded if encoded is not None
                   else self.tokenizer(*texts, **self._tokenizer_kwargs(k)))
            ids, types = list(enc["input_ids"]), enc.get("token_type_ids")
        else:
            ids, types = list(prompt.token_ids), None
            if k is not None:
                ids = ids[-k:]
        if self.uses_token_types and types is None:
            types = [0] * len(ids)
        if not ids:
            raise ValueError("The prompt cannot be empty")
        if len(ids) > max_len:
            raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's "
                             f"maximum context length ({max_len} tokens); shorten it or set "
                             f"truncate_prompt_tokens")
        return ids, (list(types) if self.uses_token_types else None)

    def prepare(self, prompts: list[PromptInput | TextPair], params: list[PoolingParams],
                task: str) -> list[PoolingRequest]:
        """Check and tokenize every prompt, all or nothing; nothing is scheduled. A bad prompt
        is a ValueError and no request is made."""
        if not prompts:
            raise ValueError("You must pass at least one prompt")
        requests = []
        encoded = self._encode_texts(prompts, params)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            check_params(self.pooler_config, p, task)
            ids, types = self.tokenize(prompt, p, encoded.get(i))
            requests.append(PoolingRequest(str(next(self._ids)), tuple(ids),
                                           None if types is None else tuple(types), p, task))
        return requests

    def encode(self, prompts: list[PromptInput | TextPair], params: list[PoolingParams],
               task: str, use_tqdm: bool = False) -> list[PoolingRequestOutput]:
        """Pool every prompt; outputs in input order. All are checked before any runs."""
        requests = self.prepare(prompts, params, task)
        for request in requests:
            self.scheduler.add_request(request)
        done: dict[str, PoolingRequestOutput] = {}
        bar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        try:
            while self.scheduler.has_unfinished_requests():
                for out in self.step():
                    done[out.request_id] = out
                    bar.update(1)
        except BaseException:
            self.scheduler.waiting.clear()
            raise
        finally:
            bar.close()
        return [done[r.request_id] for r in requests]

    def step(self) -> list[PoolingRequestOutput]:
        """One pooling step: schedule, execute, finish each row."""
        sched = self.scheduler.schedule()
        rows = self.runner.execute([PoolingInput(r.prompt_token_ids, r.token_type_ids)
                                    for r in sched.requests])
        return [PoolingRequestOutput(r.request_id,
                                     PoolingOutput(finish(self.pooler_config, row, r.params)),
                                     list(r.prompt_token_ids))
                for r, row in zip(sched.requests, rows)]


__all__ = ["PoolingEngine", "TextPair"]
