"""What LLM.encode / embed / classify / score run on a PoolingEngine (vLLM's offline forms), and
the pooling server's requests before its batcher (pooling_inputs, plan_score).

Owns the prompt forms (those of generate: a str, a token-id list, a {"prompt"} or
{"prompt_token_ids"} dict, or a list of them), broadcasting PoolingParams, and score's
pairing: 1:1, 1:N (the one text_1 paired with each text_2) and N:N, as vLLM pairs them; a
cross-encoder (a classifier with one label) scores each pair as one prompt, an embedding
model by the cosine similarity of the two embeddings. Never touches the device.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import numpy as np

from jaxllm.engine.processor import PromptInput, parse_prompts
from jaxllm.pooling.engine import PoolingEngine, TextPair
from jaxllm.pooling.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,
                                    PoolingOutput, PoolingRequestOutput,
                                    ScoringRequestOutput)
from jaxllm.pooling.params import PoolingParams


def _is_token_ids(x) -> bool:
    return (isinstance(x, Sequence) and not isinstance(x, (str, bytes)) and len(x) > 0
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in x))


def parse_pooling_prompts(prompts) -> list[PromptInput]:
    """generate's prompt forms, plus one bare token-id list or a list of them."""
    if _is_token_ids(prompts):
        return [PromptInput(None, [int(t) for t in prompts])]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes, dict)) and \
            prompts and all(_is_token_ids(p) for p in prompts):
        return [PromptInput(None, [int(t) for t in p]) for p in prompts]
    return parse_prompts(prompts)


def broadcast_pooling_params(params, n: int) -> list[PoolingParams]:
    if params is None:
        return [PoolingParams()] * n
    if isinstance(params, PoolingParams):
        return [params] * n
    if not isinstance(params, Sequence) or not all(isinstance(p, PoolingParams)
                                                   for p in params):
        raise ValueError(f"pooling_params must be a PoolingParams or a list of them, got "
                         f"{type(params).__name__}")
    if len(params) != n:
        raise ValueError(f"The lengths of prompts ({n}) and pooling_params ({len(params)}) "
                         f"must be the same.")
    return list(params)


def pooling_inputs(prompts, pooling_params=None) -> tuple[list[PromptInput],
                                                          list[PoolingParams]]:
    """The parsed prompts and one PoolingParams per prompt."""
    parsed = parse_pooling_prompts(prompts)
    return parsed, broadcast_pooling_params(pooling_params, len(parsed))


def encode(engine: PoolingEngine, prompts, pooling_params=None, task: str | None = None,
           use_tqdm: bool = False) -> list[PoolingRequestOutput]:
    """`task`: one of the model's (supported_tasks), as LLM.encode's pooling_task requires."""
    if task is None:
        raise ValueError('pooling_task is required for LLM.encode: "embed" (or LLM.embed) for '
                         'embeddings, "classify" (or LLM.classify) for class probabilities, '
                         '"token_embed" or "token_classify" for one row per token; '
                         'LLM.score for similarity scores')
    return engine.encode(*pooling_inputs(prompts, pooling_params), task, use_tqdm)


def embed(engine: PoolingEngine, prompts, pooling_params=None,
          use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
    return [EmbeddingRequestOutput.from_base(o)
            for o in encode(engine, prompts, pooling_params, "embed", use_tqdm)]


def classify(engine: PoolingEngine, prompts, pooling_params=None,
             use_tqdm: bool = False) -> list[ClassificationRequestOutput]:
    return [ClassificationRequestOutput.from_base(o)
            for o in encode(engine, prompts, pooling_params, "classify", use_tqdm)]


def _score_side(data, name: str) -> list:
    if isinstance(data, (str, dict)) or _is_token_ids(data):
        return [data]
    if isinstance(data, Sequence) and not isinstance(data, bytes):
        return list(data)
    raise ValueError(f"{name} must be a str, token ids, or a list of them; got "
                     f"{type(data).__name__}")


def pair_up(data_1, data_2) -> tuple[list, list]:
    """vLLM's pairing: 1:1, 1:N (data_1 repeated) or N:N."""
    one, two = _score_side(data_1, "data_1"), _score_side(data_2, "data_2")
    if not one or not two:
        raise ValueError("You must pass at least one prompt")
    if len(one) > 1 and len(one) != len(two):
        raise ValueError("Input lengths must be either 1:1, 1:N or N:N")
    if len(one) == 1:
        one = one * len(two)
    return one, two


@dataclasses.dataclass(frozen=True)
class ScorePlan:
    """What one score call pools (prompts, their params, the task) and how the pooled rows
    become scores: a cross-encoder's row per pair is its score; an embedding model's rows are
    the two sides' embeddings (each embedded once per occurrence, as vLLM does), scored by
    their cosine similarity."""

    prompts: list
    params: list[PoolingParams]
    task: str
    num_pairs: int

    def scores(self, outs: list[PoolingRequestOutput]) -> list[ScoringRequestOutput]:
        if self.task == "classify":
            return [ScoringRequestOutput.from_base(o) for o in outs]
        out = []
        for e1, e2 in zip(outs[:self.num_pairs], outs[self.num_pairs:]):
            a, b = e1.outputs.data, e2.outputs.data
            cos = float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-8))
            out.append(ScoringRequestOutput.from_base(PoolingRequestOutput(
                f"{e1.request_id}_{e2.request_id}", PoolingOutput(np.float32(cos).reshape(())),
                e1.prompt_token_ids + e2.prompt_token_ids)))
        return out


def plan_score(engine: PoolingEngine, data_1, data_2,
               pooling_params: PoolingParams | None = None) -> ScorePlan:
    one, two = pair_up(data_1, data_2)
    params = pooling_params or PoolingParams()
    if engine.pooler_config.task != "classify":
        prompts, plist = pooling_inputs(one + two, params)
        return ScorePlan(prompts, plist, "embed", len(one))
    if engine.model_config.num_labels != 1:
        raise ValueError("Scoring API is only enabled for num_labels == 1.")
    pairs = []
    for a, b in zip(one, two):
        if not (isinstance(a, str) and isinstance(b, str)):
            raise ValueError("a cross-encoder scores text pairs: data_1 and data_2 must "
                             "be strings")
        pairs.append(TextPair(a, b))
    return ScorePlan(pairs, [params] * len(pairs), "classify", len(pairs))


def score(engine: PoolingEngine, data_1, data_2, pooling_params: PoolingParams | None = None,
          use_tqdm: bool = False) -> list[ScoringRequestOutput]:
    plan = plan_score(engine, data_1, data_2, pooling_params)
    return plan.scores(engine.encode(plan.prompts, plan.params, plan.task, use_tqdm))


__all__ = ["ScorePlan", "classify", "embed", "encode", "pair_up", "plan_score",
           "pooling_inputs", "score"]
