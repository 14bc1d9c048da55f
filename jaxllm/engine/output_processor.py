"""EngineCoreOutputs -> user-facing RequestOutputs: detokenize, stop strings, logprobs, n > 1.

Owns, per request, everything the user sees (text, token ids, logprobs, finish reason), the
fan-in of `n` child requests into one RequestOutput, and what each step emits by the
request's `output_kind`:

    FINAL_ONLY  one RequestOutput when every child has finished, all completions in it
    CUMULATIVE  on each step a child advances: that child's completion so far
    DELTA       on each step a child advances: only its new text, token ids and logprobs

Streamed text never shows the last `len(longest stop string) - 1` characters of a running
request (they may turn out to start a stop string) nor a character still missing bytes, so
the concatenation of DELTA outputs is exactly the final output. Never schedules: when a stop
string ends a request, it reports the id back so the engine finishes it in the scheduler; an
abort names the child ids the engine core must drop. When a parent's last child ends, its ids
are released (engine/request_ids.py), on the engine's thread, before its outputs are handed on.

A completion that ends with finish_reason "error" carries no text and no tokens: nothing of
it is a result, and its detokenizer may be what failed. If building one child's output raises
(detokenizing, stop strings, logprobs), that child alone ends with "error". Either way a
failed child fails its whole request: `take_failures()` names the children the engine core
must still finish and the parents whose other children must be aborted.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.logprobs import LogprobsProcessor
from jaxllm.engine.processor import FanOut
from jaxllm.engine.request_ids import RequestIds
from jaxllm.messages import EngineCoreOutput
from jaxllm.metrics import FinishedRequest
from jaxllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxllm.research.activations import Activations
from jaxllm.research.requests import capture_of
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ParentRequest:
    """Output state of the user's request; `n` children (ids `"{index}_{request_id}"`)
    sample for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    output_kind: RequestOutputKind
    metrics: RequestMetrics
    completions: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclasses.dataclass
class ChildState:
    parent: ParentRequest
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsProcessor
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_prompt_logprobs: int = 1  # positions already filled (position 0 is always None)
    num_sent_tokens: int = 0  # DELTA: token ids (and their logprobs) already emitted
    activations: Activations | None = None  # when it captures (extra_args["capture"])


@dataclasses.dataclass(frozen=True)
class Failures:
    """What a step's failed children leave for the engine to do."""

    child_ids: list[str]  # failed here, still unfinished in the engine core
    parent_ids: list[str]  # requests with a failed child and others still running


def failed_request_output(request: FanOut) -> RequestOutput:
    """The final output of a request that failed before the engine ever held it (at
    admission): every completion ends with "error"."""
    return RequestOutput(
        request_id=request.request_id, prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids, prompt_logprobs=None,
        outputs=[_failed_completion(i) for i in range(len(request.children))], finished=True)


def _failed_completion(index: int) -> CompletionOutput:
    return CompletionOutput(index=index, text="", token_ids=[], cumulative_logprob=None,
                            logprobs=None, finish_reason="error", stop_reason=None)


class OutputProcessor:
    def __init__(self, tokenizer, metrics=None, request_ids: RequestIds | None = None):
        """metrics: a jaxllm.metrics.EngineMetrics that sees each request's latencies.
        request_ids: where a parent's ids are released once its last child has ended (the
        front end reserved them)."""
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.request_ids = request_ids if request_ids is not None else RequestIds()
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, ChildState] = {}
        self._failed_children: list[str] = []
        self._failed_parents: list[str] = []

    def add_request(self, request: FanOut, arrival_time: float) -> None:
        """All or nothing: every child's state is built before any is registered."""
        parent = ParentRequest(request.request_id, request.prompt, request.prompt_token_ids,
                               len(request.children), request.params.output_kind,
                               RequestMetrics(arrival_time=arrival_time))
        children = {}
        for index, child in enumerate(request.children):
            params = child.sampling_params
            tok = self.tokenizer if params.detokenize else None
            children[child.request_id] = ChildState(
                parent, index, params,
                IncrementalDetokenizer(tok, params, parent.prompt_token_ids),
                LogprobsProcessor(params, tok))
            capture = capture_of(params)
            if capture is not None:
                children[child.request_id].activations = Activations(capture.names)
        self.parents[request.request_id] = parent
        self.children.update(children)

    def forget(self, request: FanOut) -> None:
        """Drop a request whose admission failed, without emitting anything."""
        self.parents.pop(request.request_id, None)
        for child in request.children:
            self.children.pop(child.request_id, None)

    def take_failures(self) -> Failures:
        """The children that failed (and their parents) since the last call."""
        failures = Failures(self._failed_children, list(dict.fromkeys(self._failed_parents)))
        self._failed_children, self._failed_parents = [], []
        return failures

    def abort_requests(self, request_ids) -> tuple[list[str], list[RequestOutput]]:
        """Abort parents (all their children) or single children, by id. -> (the child ids the
        engine core must drop, the outputs that end them: finish_reason "abort" on each
        unfinished completion). Unknown ids are ignored."""
        child_ids, outputs, now = [], [], time.time()
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is None and request_id in self.children:
                parent = self.children[request_id].parent
            if parent is None:
                continue
            targets = [cid for cid, c in self.children.items() if c.parent is parent
                       and (request_id == parent.request_id or cid == request_id)]
            for child_id in targets:
                child = self.children.pop(child_id)
                child_ids.append(child_id)
                emitted = self._end_child(child, "abort", None, now)
                if emitted is not None:
                    outputs.append(emitted)
        return child_ids, outputs

    def has_unfinished(self) -> bool:
        return bool(self.children)

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """-> (the RequestOutputs this step emits, child ids that a stop string ended)."""
        now = time.time()
        emitted, stopped_by_string = [], []
        for out in outputs:
            child = self.children.get(out.req_id)
            if child is None:
                continue
            try:
                result = self._process_output(child, out, now, stopped_by_string)
            except Exception as error:
                logger.error("building the output of request %r failed (%s: %s); it finishes "
                             "with an error", out.req_id, type(error).__name__, error,
                             exc_info=error)
                self.children.pop(out.req_id, None)
                self._failed_children.append(out.req_id)
                result = self._end_child(child, "error", None, now)
            if result is not None:
                emitted.append(result)
        return emitted, stopped_by_string

    def _process_output(self, child: ChildState, out: EngineCoreOutput, now: float,
                        stopped_by_string: list[str]) -> RequestOutput | None:
        """Fold one child's step into its completion; -> what to emit for it."""
        parent = child.parent
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        parent.num_preemptions = max(parent.num_preemptions, out.num_preemptions)
        if parent.metrics.first_scheduled_time is None:
            parent.metrics.first_scheduled_time = out.scheduled_time
        if out.new_prompt_logprobs is not None:
            self._add_prompt_logprobs(child, *out.new_prompt_logprobs)
        if out.new_token_ids:
            if not child.token_ids and self.metrics is not None:  # this child's prompt is done
                self.metrics.record_prompt(len(parent.prompt_token_ids), out.num_cached_tokens)
            self._token_times(parent.metrics, now)
        if out.new_logprobs is not None:
            child.logprobs.add_sample_logprobs(out.new_logprobs)
        if out.new_activations is not None:
            child.activations.add(out.new_activations)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        child.token_ids.extend(out.new_token_ids)
        text_ids = out.new_token_ids
        if finish_reason == "stop" and not child.params.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # the EOS / stop token itself is not shown as text
        stop_str = child.detokenizer.update(text_ids)
        if stop_str is not None:
            # A stop string wins even when the same token also hit max_tokens (vLLM).
            if finish_reason is None:
                stopped_by_string.append(out.req_id)
            finish_reason, stop_reason = "stop", stop_str
        if finish_reason is not None:
            del self.children[out.req_id]
            return self._end_child(child, finish_reason, stop_reason, now)
        if parent.output_kind != RequestOutputKind.FINAL_ONLY and out.new_token_ids:
            return self._stream_output(child, self._running_completion(child))
        return None

    def _token_times(self, m: RequestMetrics, now: float) -> None:
        if m.last_token_time is not None and self.metrics is not None:
            self.metrics.observe("jaxllm:inter_token_latency_seconds", now - m.last_token_time)
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now

    # ---- building outputs -------------------------------------------------------------

    def _end_child(self, child: ChildState, finish_reason: str, stop_reason, now: float
                   ) -> RequestOutput | None:
        """Record a child's final completion; -> what to emit for it (None while a
        FINAL_ONLY parent still waits for other children)."""
        parent = child.parent
        if finish_reason == "error":
            final = streamed = _failed_completion(child.index)
        else:
            final = self._completion(child, finish_reason, stop_reason, final=True, delta=False)
            streamed = None
        parent.completions[child.index] = final
        done = len(parent.completions) == parent.n
        if finish_reason == "error" and not done:
            self._failed_parents.append(parent.request_id)
        if done and self.parents.pop(parent.request_id, None) is not None:
            parent.metrics.finished_time = now
            self.request_ids.release(parent.request_id)
            if self.metrics is not None:
                lengths = [len(c.token_ids) for c in parent.completions.values()]
                self.metrics.record_request(FinishedRequest(
                    parent.metrics, len(parent.prompt_token_ids), sum(lengths), max(lengths),
                    [c.finish_reason for c in parent.completions.values()], parent.n,
                    child.params.max_tokens, parent.num_cached_tokens, parent.num_preemptions))
        if parent.output_kind == RequestOutputKind.FINAL_ONLY:
            return self._make_output(parent) if done else None
        if streamed is None:
            streamed = self._completion(
                child, finish_reason, stop_reason, final=True,
                delta=parent.output_kind == RequestOutputKind.DELTA)
        return self._stream_output(child, streamed)

    def _running_completion(self, child: ChildState) -> CompletionOutput:
        delta = child.parent.output_kind == RequestOutputKind.DELTA
        return self._completion(child, None, None, final=False, delta=delta)

    def _stream_output(self, child: ChildState, completion: CompletionOutput) -> RequestOutput:
        """One child's CUMULATIVE or DELTA completion, in a RequestOutput of its parent."""
        parent = child.parent
        prompt_logprobs = parent.prompt_logprobs
        if parent.output_kind == RequestOutputKind.DELTA and parent.prompt_logprobs_sent:
            prompt_logprobs = None
        parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, prompt_logprobs=prompt_logprobs,
            outputs=[completion], finished=parent.request_id not in self.parents,
            metrics=parent.metrics, num_cached_tokens=parent.num_cached_tokens)

    @staticmethod
    def _completion(child: ChildState, finish_reason, stop_reason, *, final: bool,
                    delta: bool) -> CompletionOutput:
        text = child.detokenizer.get_next_output_text(finished=final, delta=delta)
        start = child.num_sent_tokens if delta else 0
        if delta:
            child.num_sent_tokens = len(child.token_ids)
        logprobs = child.logprobs.logprobs
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=child.token_ids[start:],
            cumulative_logprob=child.logprobs.cumulative_logprob,
            logprobs=None if logprobs is None else logprobs[start:],
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            activations=child.activations,
        )

    def _add_prompt_logprobs(self, child: ChildState, first_position: int, lists) -> None:
        # Chunks can repeat after a preemption (the prompt is recomputed): keep the first.
        skip = child.num_prompt_logprobs - first_position
        if skip >= len(lists.logprobs):
            return
        if skip > 0:
            lists = dataclasses.replace(
                lists, logprob_token_ids=lists.logprob_token_ids[skip:],
                logprobs=lists.logprobs[skip:], sampled_token_ranks=lists.sampled_token_ranks[skip:])
        child.logprobs.add_prompt_logprobs(lists)
        child.num_prompt_logprobs += len(lists.logprobs)
        if child.index == 0:
            child.parent.prompt_logprobs = child.logprobs.prompt_logprobs

    @staticmethod
    def _make_output(parent: ParentRequest) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=[parent.completions[i] for i in range(parent.n)],
            finished=True,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
        )
