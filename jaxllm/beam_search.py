"""Beam search with vLLM's API: `BeamSearchParams`, `LLM.beam_search`, and
`LLM.generate(prompt, BeamSearchParams(...))`.

Owns: the beams of each prompt, their scores, and turning each search step into one batch of
one-token requests for the engine. Never touches the scheduler, the block pool or the device:
beams share KV through the prefix cache. A step's request for a beam is the beam's tokens; its
full blocks were computed (and cached) by the request of the beam it grew from, so a step
computes at most the beam's last partial block plus one token.

One step, as vLLM (after HF transformers) does it, for every prompt at once:

    beams (<= beam_width)  --generate, max_tokens=1, logprobs=2*beam_width-->
    candidates = every beam x its 2*beam_width most likely next tokens
    EOS candidates -> completed (unless ignore_eos); the rest, best beam_width by score
    -> next step's beams

Score (vLLM's): cum_logprob / len(tokens) ** length_penalty, where tokens are prompt +
generated, less a final EOS. The search ends after max_tokens steps or when no beam is left;
the answer is the best beam_width of completed + remaining beams, best first.
"""

from __future__ import annotations

import dataclasses
import numbers

from jaxllm.engine.processor import parse_prompts
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam. tokens: the prompt's token ids then the generated ones (vLLM's layout);
    logprobs: one dict per generated token (its 2*beam_width candidates); text: the generated
    text (without a final EOS unless include_stop_str_in_output)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
               length_penalty: float) -> float:
    """vLLM's ranking: cumulative logprob over length ** length_penalty (a final EOS is not
    counted in the length)."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length ** length_penalty)


@dataclasses.dataclass
class _Instance:
    """The search for one prompt."""

    prompt: str | None
    prompt_token_ids: list[int]
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


class BeamSearch:
    """Beam searches over one engine's tokenizer and limits; the caller runs each step's
    one-token requests (`run` with LLM.generate; the server with AsyncLLM, in turn:
    `start`, then `step_prompts` / `advance` until no beam is left)."""

    def __init__(self, engine, params: BeamSearchParams):
        """engine: the LLMEngine whose tokenizer, processor and limits apply."""
        self.params = params
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.eos_token_id = engine.processor.eos_token_id
        self.max_model_len = engine.config.max_model_len
        num_candidates = 2 * params.beam_width
        if num_candidates > engine.config.max_logprobs >= 0:
            raise ValueError(f"beam_width must be at most {engine.config.max_logprobs // 2} "
                             f"(2 * beam_width logprobs per step; max_logprobs="
                             f"{engine.config.max_logprobs}), got {params.beam_width}.")
        self.step_params = SamplingParams(max_tokens=1, logprobs=num_candidates,
                                          temperature=params.temperature, ignore_eos=True,
                                          detokenize=False)

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos_token_id,
                          self.params.length_penalty)

    def start(self, prompts) -> list[_Instance]:
        """One search per prompt, every prompt checked before any step runs."""
        processor = self.engine.processor
        instances = []
        for prompt in parse_prompts(prompts):
            ids = processor.tokenize_prompt(prompt)
            processor.check_prompt(ids)
            instances.append(_Instance(prompt.text, list(ids),
                                       [BeamSearchSequence(tokens=list(ids), logprobs=[])]))
        return instances

    def step_prompts(self, instances: list[_Instance]) -> list[BeamSearchSequence]:
        """The beams this step grows (beams at the context limit complete instead); [] when
        none is left."""
        for instance in instances:
            full = [b for b in instance.beams if len(b.tokens) >= self.max_model_len]
            for beam in full:
                beam.finish_reason = "length"
            instance.completed += full
            instance.beams = [b for b in instance.beams if b not in full]
        return [b for instance in instances for b in instance.beams]

    def advance(self, instances: list[_Instance], beams: list[BeamSearchSequence],
                outputs: list[RequestOutput]) -> None:
        """Each instance keeps its best beam_width candidates of this step."""
        grown = iter(zip(beams, outputs))
        for instance in instances:
            candidates = []
            for beam, out in (next(grown) for _ in instance.beams):
                candidates += self._expand(instance, beam, out.outputs[0].logprobs[0])
            candidates.sort(key=self.score, reverse=True)
            instance.beams = candidates[:self.params.beam_width]

    def run(self, prompts, generate, lora_request=None) -> list[_Instance]:
        """generate(list of {"prompt_token_ids"}, params, lora_request) -> one RequestOutput
        each. lora_request: one LoRARequest, or one per prompt (its beams run with it)."""
        instances = self.start(prompts)
        per_prompt = isinstance(lora_request, (list, tuple))
        if per_prompt and len(lora_request) != len(instances):
            raise ValueError(f"The lengths of prompts ({len(instances)}) and lora_request "
                             f"({len(lora_request)}) must be the same.")
        for _ in range(self.params.max_tokens):
            beams = self.step_prompts(instances)
            if not beams:
                break
            loras = ([lr for i, lr in zip(instances, lora_request) for _ in i.beams]
                     if per_prompt else lora_request)
            self.advance(instances, beams, generate(
                [{"prompt_token_ids": b.tokens} for b in beams], self.step_params, loras))
        return instances

    def _expand(self, instance: _Instance, beam: BeamSearchSequence,
                logprobs: dict[int, Logprob]) -> list[BeamSearchSequence]:
        """Beam + each candidate token; EOS candidates go straight to `completed`."""
        grown = []
        for token_id, lp in logprobs.items():
            child = BeamSearchSequence(tokens=beam.tokens + [token_id],
                                       logprobs=beam.logprobs + [logprobs],
                                       cum_logprob=beam.cum_logprob + lp.logprob)
            if token_id == self.eos_token_id and not self.params.ignore_eos:
                child.finish_reason = "stop"
                instance.completed.append(child)
            else:
                grown.append(child)
        return grown

    def finish(self, instance: _Instance) -> list[BeamSearchSequence]:
        """The best beam_width beams, best first, with text and finish reasons."""
        ranked = sorted(instance.completed + instance.beams, key=self.score, reverse=True)
        best = ranked[:self.params.beam_width]
        for beam in best:
            generated = beam.tokens[len(instance.prompt_token_ids):]
            if beam.finish_reason is None:
                beam.finish_reason = "length"
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = self.tokenizer.decode(generated, skip_special_tokens=True)
            for entry in beam.logprobs:  # the steps ran without detokenizing
                for token_id, lp in entry.items():
                    if lp.decoded_token is None:
                        lp.decoded_token = self.tokenizer.decode([token_id])
        return best


def _generate(llm):
    return lambda prompts, params, loras: llm.generate(prompts, params, use_tqdm=False,
                                                       lora_request=loras)


def beam_search(llm, prompts, params: BeamSearchParams, lora_request=None
                ) -> list[BeamSearchOutput]:
    search = BeamSearch(llm.llm_engine, params)
    return [BeamSearchOutput(search.finish(i))
            for i in search.run(prompts, _generate(llm), lora_request)]


def beam_search_request_outputs(llm, prompts, params: BeamSearchParams, lora_request=None
                                ) -> list[RequestOutput]:
    """`LLM.generate(prompts, BeamSearchParams)`: one RequestOutput per prompt whose `outputs`
    are its beams, best first (token_ids and logprobs of the generated part only)."""
    search = BeamSearch(llm.llm_engine, params)
    return request_outputs(search, search.run(prompts, _generate(llm), lora_request))


def request_outputs(search: BeamSearch, instances: list[_Instance]) -> list[RequestOutput]:
    """Finished searches as RequestOutputs, one per prompt, its beams best first."""
    results = []
    for i, instance in enumerate(instances):
        n = len(instance.prompt_token_ids)
        outputs = [CompletionOutput(index=k, text=beam.text,
                                    token_ids=beam.tokens[n:], cumulative_logprob=beam.cum_logprob,
                                    logprobs=beam.logprobs, finish_reason=beam.finish_reason)
                   for k, beam in enumerate(search.finish(instance))]
        results.append(RequestOutput(request_id=f"beam-{i}", prompt=instance.prompt,
                                     prompt_token_ids=instance.prompt_token_ids,
                                     prompt_logprobs=None, outputs=outputs, finished=True))
    return results


__all__ = ["BeamSearch", "BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput",
           "beam_search", "beam_search_request_outputs", "beam_score", "request_outputs"]
