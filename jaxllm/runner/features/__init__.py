"""The step features (runner/step_features.py) an engine's configuration asks for."""

from __future__ import annotations

from jaxllm.research.requests import ResearchConfig
from jaxllm.runner.features.capture import ActivationCapture
from jaxllm.runner.features.steering import Steering
from jaxllm.runner.step_features import StepFeature


def make_step_features(research: ResearchConfig | None, *, num_slots: int,
                       hidden_size: int) -> tuple[StepFeature, ...]:
    """The features of an engine, in the order they apply at a shared point: steering
    first, so that a capture sees the steered residual stream."""
    research = research or ResearchConfig()
    features: list[StepFeature] = []
    if research.steer_layers:
        features.append(Steering(research.steer_layers, num_slots, hidden_size))
    if research.captures:
        features.append(ActivationCapture(research, num_slots))
    return tuple(features)


__all__ = ["make_step_features"]
