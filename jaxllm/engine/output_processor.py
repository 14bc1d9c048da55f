"""EngineCoreOutputs -> user-facing RequestOutputs: detokenize, stop strings, logprobs, n > 1.

Owns, per request, everything the user sees (text, token ids, logprobs, finish reason) and
the fan-in of `n` child requests into one RequestOutput. Never schedules: when a stop string
ends a request, it reports the id back so the engine finishes it in the scheduler; an abort
names the child ids the engine core must drop.
"""

from __future__ import annotations

import dataclasses
import time

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.logprobs import LogprobsProcessor
from jaxllm.engine.processor import FanOut
from jaxllm.messages import EngineCoreOutput
from jaxllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxllm.sampling_params import SamplingParams


@dataclasses.dataclass
class ParentRequest:
    """Output state of the user's request; `n` children (ids `"{index}_{request_id}"`)
    sample for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    metrics: RequestMetrics
    completions: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)
    prompt_logprobs: list | None = None


@dataclasses.dataclass
class ChildState:
    parent: ParentRequest
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsProcessor
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_prompt_logprobs: int = 1  # positions already filled (position 0 is always None)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, ChildState] = {}

    def add_request(self, request: FanOut, arrival_time: float) -> None:
        parent = ParentRequest(request.request_id, request.prompt, request.prompt_token_ids,
                               len(request.children), RequestMetrics(arrival_time=arrival_time))
        self.parents[request.request_id] = parent
        for index, child in enumerate(request.children):
            params = child.sampling_params
            tok = self.tokenizer if params.detokenize else None
            self.children[child.request_id] = ChildState(
                parent, index, params,
                IncrementalDetokenizer(tok, params, parent.prompt_token_ids),
                LogprobsProcessor(params, tok))

    def is_live(self, request_id: str) -> bool:
        """Is this id (a parent's or a child's) still producing output?"""
        return request_id in self.parents or request_id in self.children

    def abort_requests(self, request_ids) -> tuple[list[str], list[RequestOutput]]:
        """Abort parents (all their children) or single children, by id. -> (the child ids the
        engine core must drop, one final RequestOutput per affected parent, its unfinished
        completions marked finish_reason "abort"). Unknown ids are ignored."""
        child_ids, finished, now = [], [], time.time()
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is None and request_id in self.children:
                parent = self.children[request_id].parent
            if parent is None:
                continue
            targets = [cid for cid, c in self.children.items() if c.parent is parent
                       and (request_id == parent.request_id or cid == request_id)]
            for child_id in targets:
                self._finish_child(self.children.pop(child_id), "abort", None)
                child_ids.append(child_id)
            if len(parent.completions) == parent.n:
                finished.append(self._close(parent, now))
        return child_ids, finished

    def has_unfinished(self) -> bool:
        return bool(self.children)

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """-> (finished parent outputs, child ids that a stop string ended)."""
        now = time.time()
        finished, stopped_by_string = [], []
        for out in outputs:
            child = self.children.get(out.req_id)
            if child is None:
                continue
            parent = child.parent
            if out.new_prompt_logprobs is not None:
                self._add_prompt_logprobs(child, *out.new_prompt_logprobs)
            if out.new_token_ids:
                parent.metrics.first_token_time = parent.metrics.first_token_time or now
                parent.metrics.last_token_time = now
            if out.new_logprobs is not None:
                child.logprobs.add_sample_logprobs(out.new_logprobs)
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
                self._finish_child(child, finish_reason, stop_reason)
                del self.children[out.req_id]
                if len(parent.completions) == parent.n:
                    finished.append(self._close(parent, now))
        return finished, stopped_by_string

    def _close(self, parent: ParentRequest, now: float) -> RequestOutput:
        parent.metrics.finished_time = now
        del self.parents[parent.request_id]
        return self._make_output(parent)

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

    def _finish_child(self, child: ChildState, finish_reason: str, stop_reason) -> None:
        child.parent.completions[child.index] = CompletionOutput(
            index=child.index,
            text=child.detokenizer.output_text,
            token_ids=list(child.token_ids),
            cumulative_logprob=child.logprobs.cumulative_logprob,
            logprobs=child.logprobs.logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )

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
        )
