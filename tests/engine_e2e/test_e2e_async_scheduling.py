"""Async scheduling gives exactly the outputs of synchronous scheduling.

With async scheduling step N+1 is scheduled and dispatched before step N's tokens reach the
host: decode rows are fed from the device's token history, penalties read it too, finished
requests are discovered one step late (their extra token is dropped), and a preemption makes
in-flight tokens stale. None of that may change a single token, logprob or finish reason.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import SamplingParams

from tiny_model import metric_values

PROMPTS = [[100 + (7 * i + j) % 500 for j in range(n)] for i, n in
           enumerate((3, 17, 40, 9, 64, 5, 23, 31))]


def workload():
    return [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=17, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=4, max_tokens=12,
                       ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, presence_penalty=0.6, frequency_penalty=0.4,
                       repetition_penalty=1.3, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=25, min_tokens=4, stop_token_ids=[7]),
        SamplingParams(temperature=0.9, seed=6, max_tokens=9, stop=["e"], ignore_eos=True),
        SamplingParams(temperature=0.5, seed=8, min_p=0.1, max_tokens=30, ignore_eos=True,
                       prompt_logprobs=1),
        SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True),
    ]


def tokens_and_text(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outputs]


def logprob_values(outputs):
    """Every logprob value (sample and prompt) of a run, flattened in a fixed order."""
    values = []
    for o in outputs:
        for c in o.outputs:
            values += [c.cumulative_logprob or 0.0]
            values += [lp.logprob for d in c.logprobs or [] for lp in d.values()]
        values += [lp.logprob for d in o.prompt_logprobs or [] if d for lp in d.values()]
    return values


@pytest.mark.parametrize("config", [
    dict(),  # roomy cache, budget 64: chunked prefill of the long prompts
    dict(num_gpu_blocks_override=12, max_model_len=128),  # preemption under pressure
], ids=["roomy", "preempting"])
def test_async_scheduling_changes_nothing(make_tiny_llm, config):
    """Without preemption both modes run the same steps: everything is bit-identical. Under
    preemption the two modes preempt at different moments (async schedules a step ahead),
    so recomputed positions run in differently shaped batches: tokens, text and finish
    reasons are still identical, logprobs agree to float32 rounding."""
    runs = {}
    for mode in (False, True):
        llm = make_tiny_llm(async_scheduling=mode, **config)
        runs[mode] = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], workload(),
                                  use_tqdm=False)
        if "num_gpu_blocks_override" in config:
            assert metric_values(llm)["jaxllm:num_preemptions_total"] > 0
        assert metric_values(llm)["jaxllm:kv_cache_usage_perc"] == 0.0
    assert tokens_and_text(runs[True]) == tokens_and_text(runs[False])
    if "num_gpu_blocks_override" in config:
        np.testing.assert_allclose(logprob_values(runs[True]), logprob_values(runs[False]),
                                   rtol=1e-5, atol=1e-5)
    else:
        assert logprob_values(runs[True]) == logprob_values(runs[False])
