"""Speculative decoding: proposals on the host, exact verification inside the unified step.

    config.py      SpeculativeConfig (vLLM's speculative_config), validated
    ngram.py       NgramProposer: prompt-lookup drafts from a request's token history (numpy)
    scheduling.py  SpecDecodeScheduling: which running rows get drafts, rollback, counters
    rejection.py   rejection_sample: Leviathan et al.'s accept / recover / bonus (traceable)
    feature.py     SpecDecodeFeature: the step feature that verifies drafts on the device
"""

from jaxllm.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
