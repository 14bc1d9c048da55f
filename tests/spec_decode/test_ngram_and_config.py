"""SpeculativeConfig's validation (vLLM's rules and messages) and the n-gram proposer against
a plain loop that states vLLM's rule (longest n in [min, max], earliest occurrence)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxllm.config import EngineConfig
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram import NgramProposer


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    N = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= N:
            continue
        suffix = tokens[N - n:]
        for start in range(0, N - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_proposer_matches_the_rule_on_random_histories():
    rng = np.random.default_rng(0)
    proposer = NgramProposer(4, 2, 4)
    found = 0
    for _ in range(400):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        got = proposer.propose(np.asarray(tokens)).tolist()
        assert got == reference(tokens, 4, 2, 4), tokens
        found += bool(got)
    assert found > 100  # the histories did exercise matches
    assert proposer.propose(np.array([1, 2, 3, 1, 2, 3, 1, 2]), k=2).tolist() == [3, 1]
    assert proposer.propose(np.array([5, 6, 7])).tolist() == []


def test_config_defaults_and_refusals(caplog):
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    bad = [({"method": "ngram"}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "beam", "num_speculative_tokens": 2}, "method must be one of"),
           ({"method": "eagle", "num_speculative_tokens": 2}, "not supported yet"),
           ({"method": "draft_model", "num_speculative_tokens": 2},
            "needed by, and only by, method 'draft_model'"),
           ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2},
            "needed by, and only by, method 'draft_model'"),
           ({"model": 3, "num_speculative_tokens": 2}, "model must be a str"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
             "prompt_lookup_max": 3}, "prompt_lookup_min=5 must be <= prompt_lookup_max=3"),
           ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys")]
    # vLLM's draft-model form: the model alone sets the method; "[ngram]" is n-gram's.
    c = SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 2})
    assert (c.method, c.model) == ("draft_model", "/some/draft")
    c = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2})
    assert (c.method, c.model) == ("ngram", None)
    for d, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(d)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="async_scheduling=True cannot run with ngram-based "
                       "speculative decoding here; pass async_scheduling=False"):
        EngineConfig(speculative_config=spec, async_scheduling=True)
    with caplog.at_level(logging.WARNING, logger="jaxllm.config"):
        assert EngineConfig(speculative_config=spec).async_scheduling is False  # vLLM's rule
    assert caplog.messages == ["Async scheduling is not supported with ngram-based "
                               "speculative decoding and will be disabled."]
    assert EngineConfig().async_scheduling is True
    assert EngineConfig(speculative_config=spec,
                        async_scheduling=False).speculative_config.num_speculative_tokens == 2
