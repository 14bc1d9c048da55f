"""Research from the fast path: what a request may ask of the compiled step besides tokens.

    LLM(research=ResearchConfig(capture_layers=(3, 7), steer_layers=(5,), ablate_layers=(2,)))
    SamplingParams(extra_args={"capture": Capture(layers=(3,), positions="prompt"),
                               "steer": Steer(layer=5, vector=v, alpha=4.0),
                               "ablate": Ablate(layer=2, heads=(0, 3))})
    out.outputs[0].activations["layers.3.resid_post"]   # [P, D] float32, P positions

This package is imported by the engine, so it never imports jax; the device halves of these
features live in jaxllm/runner/features/.
"""

from jaxllm.research.activations import ActivationChunk, Activations
from jaxllm.research.requests import (CAPTURE_SITES, Ablate, Capture, ResearchConfig,
                                      ResearchLimits, Steer)

__all__ = ["Ablate", "ActivationChunk", "Activations", "CAPTURE_SITES", "Capture",
           "ResearchConfig", "ResearchLimits", "Steer"]
