"""Structured outputs on the host: grammars compiled off the engine loop, one matcher per
request, and the token bitmasks of each step (vLLM v1's StructuredOutputManager, with the
llguidance backend, vLLM's "guidance").

Owns: turning a request's `StructuredOutputsParams` into an llguidance grammar (and the
admission check that it compiles), a thread pool that compiles grammars while the engine
loop goes on, the cache of compiled grammars by (kind, spec, options), each request's
`LLMatcher` (advanced by the tokens the request keeps), and filling one step's bitmask rows
[k, ceil(V / 32)] int32 in parallel (llguidance's own thread pool). Never touches a device
and never decides what runs (the scheduler asks `is_ready` and `grammar_bitmask`).

    add_request -> compile job (pool) ---- cache[(kind, spec, options)] = template matcher
    schedule(): waiting request runs only once its future is done (vLLM's WAITING_FOR_FSM);
                then its matcher = template.deep_copy()
    schedule(): grammar_bitmask(rows that sample) -> SchedulerOutput.grammar_bitmask
    update_from_output: accept_tokens(request, new tokens)    (a refused token: it fails)

A request's tokens survive preemption (recompute keeps them), so its matcher does too.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np

from jaxllm.structured_outputs import StructuredOutputsConfig, StructuredOutputsParams
from jaxllm.value_ranges import ParameterError


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not checked: see `check_grammar`)."""
    llg = llguidance
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if params.disable_additional_properties:
            schema = _no_additional_properties(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind} is not a valid JSON schema: {e}") \
                from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(params.choice))
    if kind == "grammar":
        try:
            return llg.grammar_from("grammar", params.grammar)
        except ValueError as e:
            raise ValueError(f"structured_outputs.grammar is not a valid grammar: {e}") \
                from None
    raise ValueError(f"structured_outputs.{kind} is not supported")


def check_grammar(params: StructuredOutputsParams) -> None:
    """ValueError naming the field when the constraint does not compile (a few ms, without
    the tokenizer: what admission can check)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_of(params))
    if error:
        raise ParameterError(f"structured_outputs.{params.kind} is invalid: {error}",
                             f"structured_outputs.{params.kind}")


def _no_additional_properties(schema):
    """A copy of the schema where every object that does not set additionalProperties
    gets additionalProperties: false (vLLM's disable_additional_properties)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class StructuredOutputRequest:
    """One request's grammar: the compile job, then its own matcher."""

    def __init__(self, future: Future):
        self.future = future
        self.matcher = None

    def is_ready(self) -> bool:
        """Has its grammar compiled? Raises ValueError if the compile failed."""
        if self.matcher is not None:
            return True
        if not self.future.done():
            return False
        self.matcher = self.future.result().deep_copy()  # raises the compile's error
        return True


class StructuredOutputManager:
    def __init__(self, config: StructuredOutputsConfig, tokenizer, vocab_size: int,
                 max_workers: int = 2):
        """tokenizer: the engine's Hugging Face fast tokenizer; vocab_size: the model's
        (the bitmask's width covers it: ids past the tokenizer's are never allowed)."""
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.eos_token_id = tokenizer.eos_token_id
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._ll_executor = None
        self._cache: dict[tuple, Future] = {}  # (kind, spec, options) -> template matcher
        # The llguidance tokenizer takes ~0.5 s to build: started now, in the pool, so the
        # first constrained request does not wait for it.
        self._pool.submit(self._tokenizer)
        self.num_compiles = 0
        # Host time filling bitmasks, the steps that filled some and their rows (benchmarks).
        self.mask_fill_seconds = 0.0
        self.num_mask_fills = 0
        self.num_mask_rows = 0

    def _tokenizer(self):
        with self._lock:  # ~1 s the first time: built in the pool, never on the engine loop
            if self._ll_tokenizer is None:
                # Here, not at import: llguidance.hf imports transformers, which must come
                # after jaxllm.tokenizer quiets its no-torch advisory.
                import llguidance.hf  # noqa: PLC0415
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer,
                                                                  n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def _compile(self, params: StructuredOutputsParams):
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_of(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: "
                             f"{matcher.get_error()}")
        self.num_compiles += 1
        return matcher

    def grammar_init(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start (or reuse) the compile of this constraint; returns at once."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._cache[key] = self._pool.submit(self._compile, params)
        return StructuredOutputRequest(future)

    def wait_for_any(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Block up to `timeout` s for one of these compiles (called only when nothing else
        can run, so that an idle engine does not spin)."""
        pending = [r.future for r in requests if not r.future.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def grammar_bitmask(self, requests: list[StructuredOutputRequest],
                        drafts: list[list[int]] | None = None) -> np.ndarray:
        """[n, P, ceil(V / 32)] int32: the tokens request i's grammar allows (EOS only where
        the grammar may end), filled in parallel. Row [i, 0] is for the position it samples;
        with speculative drafts (drafts[i], already valid: validate_drafts), that comes after
        them all, and row [i, 1 + j] is the position that verifies draft j (the grammar
        after drafts[i][:j]). P = 1 + the most drafts of any request; rows past a request's
        own drafts allow everything. The matchers are advanced through the drafts and rolled
        back: they end where they began."""
        t0 = time.perf_counter()
        drafts = drafts or [[] for _ in requests]
        P = 1 + max((len(d) for d in drafts), default=0)
        bitmask = np.full((len(requests), P, self.num_words), -1, np.int32)
        if self._ll_executor is None:
            self._ll_executor = llguidance.LLExecutor()
        flat = bitmask.reshape(len(requests) * P, self.num_words)
        for j in range(P):  # position j: after j drafts
            rows = [(r.matcher, i * P + (1 + j if j < len(d) else 0))
                    for i, (r, d) in enumerate(zip(requests, drafts)) if j <= len(d)]
            llguidance.numpy.fill_next_token_bitmask_par(self._ll_executor, rows, flat)
            for r, d in zip(requests, drafts):
                if j < len(d) and not r.matcher.consume_token(d[j]):
                    raise ValueError(f"the grammar refused draft token {d[j]}: "
                                     f"{r.matcher.get_error()}")
        for r, d in zip(requests, drafts):
            if d:
                r.matcher.rollback(len(d))
        self.mask_fill_seconds += time.perf_counter() - t0
        self.num_mask_fills += 1
        self.num_mask_rows += len(requests)
        return bitmask

    @staticmethod
    def validate_drafts(request: StructuredOutputRequest, drafts) -> int:
        """How many of the leading drafts the grammar accepts (the matcher does not move)."""
        return request.matcher.validate_tokens([int(t) for t in drafts])

    def accept_tokens(self, request: StructuredOutputRequest, token_ids: list[int]) -> None:
        """Advance the matcher; ValueError if the grammar refuses a token (the request then
        fails alone). A grammar that is complete allows only EOS, which ends the request
        and leaves the matcher where it is."""
        matcher = request.matcher
        for token in token_ids:
            if matcher.is_stopped() and token == self.eos_token_id:
                continue
            if not matcher.consume_token(token):
                raise ValueError(f"the grammar refused sampled token {token}: "
                                 f"{matcher.get_error()}")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
