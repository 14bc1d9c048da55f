"""The step features (runner/step_features.py) an engine's configuration asks for."""

from __future__ import annotations

from jaxllm.research.requests import ResearchConfig
from jaxllm.runner.features.ablation import HeadAblationFeature
from jaxllm.runner.features.capture import ActivationCapture
from jaxllm.runner.features.grammar import GrammarBitmask
from jaxllm.runner.features.logit_bias import LogitBias
from jaxllm.runner.features.steering import Steering
from jaxllm.runner.step_features import StepFeature


def make_step_features(research: ResearchConfig | None, *, num_slots: int, hidden_size: int,
                       num_heads: int = 0, head_dim: int = 0, vocab_size: int = 0,
                       num_speculative_tokens: int = 0) -> tuple[StepFeature, ...]:
    """The features of an engine, in the order they apply at a shared point: ablation and
    steering first, so that a capture sees the values the model goes on with. vocab_size
    > 0: logit biases, then grammar bitmasks, on the logits (a bias cannot lift a token
    the grammar masked)."""
    research = research or ResearchConfig()
    features: list[StepFeature] = []
    if vocab_size:
        features.append(LogitBias(num_slots, vocab_size))
        features.append(GrammarBitmask(num_slots, vocab_size, num_speculative_tokens))
    if research.ablate_layers:
        features.append(HeadAblationFeature(research.ablate_layers, num_slots, num_heads,
                                            head_dim))
    if research.steer_layers:
        features.append(Steering(research.steer_layers, num_slots, hidden_size))
    if research.captures:
        features.append(ActivationCapture(research, num_slots))
    return tuple(features)


__all__ = ["make_step_features"]
