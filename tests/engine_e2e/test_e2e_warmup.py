"""After warm-up, serving never compiles (STYLE habit 9), seen two ways.

* the runner's own count of compiled executables does not move, and
* JAX itself reports no tracing, lowering or XLA compilation at all while `generate` runs
  (a listener on JAX's "/jax/core/compile/*" duration events, which also catches eager jax
  ops and jits outside the runner's bookkeeping).

The listener is shown to work in the same test: compiling one shape outside the buckets
afterwards is counted. The engine serves LoRA (max_loras=1): adapters loaded and swapped
into its one device slot while serving compile nothing either.
"""

from __future__ import annotations

import collections
import contextlib
import time

import pytest
from jax import monitoring

from jaxllm import SamplingParams, StructuredOutputsParams
from jaxllm.lora.request import LoRARequest

COMPILE_EVENT_PREFIX = "/jax/core/compile/"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def jax_compile_events():
    """Counter of JAX's compile-pipeline events (trace, lower, backend compile) in the block."""
    events: collections.Counter[str] = collections.Counter()

    def listener(event: str, duration: float, **kwargs) -> None:
        if event.startswith(COMPILE_EVENT_PREFIX):
            events[event] += 1

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[LoRARequest]:
    """Two random PEFT-format adapters of the tiny model."""
    from lora_adapters import write_random_adapter
    from tiny_model import TINY_CONFIG

    root = tmp_path_factory.mktemp("warm_loras")
    return [LoRARequest(f"a{i}", i, write_random_adapter(root / f"a{i}", TINY_CONFIG, seed=i,
                                                          r=4 * i)) for i in (1, 2)]


@pytest.fixture(scope="module")
def warm_llm(make_tiny_llm):
    t0 = time.perf_counter()
    llm = make_tiny_llm(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                        enforce_eager=False, enable_lora=True, max_loras=1)
    engine = llm.llm_engine
    print(f"\nwarm-up: {engine.runner.num_compiles} compiles in {engine.warmup_seconds:.1f} s "
          f"(LLM() total {time.perf_counter() - t0:.1f} s)")
    return llm


def test_generate_after_warmup_compiles_nothing(warm_llm, tokenizer, adapters):
    runner = warm_llm.llm_engine.runner
    # One program per token bucket (2, 4, 8, 16, 32) at one width (64 // 16 = 4 blocks):
    # sampling and prompt logprobs run inside the step.
    assert runner.step_fns.num_compiles == 5
    # Beside the steps: the block copy and the history row upload, and one program per
    # upload bucket of the per-slot device rows: block tables (4), bad words (16, 64, 256,
    # 512), allowed-token bits (1, 2, 4 rows), logit biases (1, 2, 4 rows), grammar
    # bitmasks (1, 2, 4 rows), LoRA: each request's adapter slot (1, 2, 4 rows) and the 14
    # weight tables (7 targets x A, B; one adapter per upload).
    assert runner.num_compiles == 5 + 2 + 1 + 4 + 3 + 3 + 3 + 3 + 14
    compiled = runner.num_compiles
    long_prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 5)["input_ids"]
    assert 32 < len(long_prompt) < 64  # chunked prefill under the 32-token budget
    prompts = ["Hi", {"prompt_token_ids": long_prompt}, "x y z", "Once upon a time", "A",
               "The capital of France is", "Hello", "JSON:", "Pick:"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.2, max_tokens=9, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=1, logprobs=1,
                       min_tokens=3, stop=["the"]),
        SamplingParams(n=2, temperature=0.9, min_p=0.05, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[11, 500, 4000],
                       bad_words=["the", "hello world"]),
        # Grammar bitmasks (structured outputs): uploads and the masked step are warm too.
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, structured_outputs=(
            StructuredOutputsParams(json={"type": "object", "properties": {
                "a": {"type": "integer"}}, "required": ["a"]}))),
        SamplingParams(n=3, temperature=1.0, max_tokens=8, structured_outputs=(
            StructuredOutputsParams(choice=["red", "green", "blue"]))),
    ]
    # Two adapters for one device slot: loaded, written and swapped while serving.
    loras = [adapters[0], None, adapters[1], None, adapters[0], None, None, None, None]
    with jax_compile_events() as events:
        outputs = warm_llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [len(o.outputs) for o in outputs] == [1, 1, 1, 1, 1, 2, 1, 1, 3]
    assert all(c.text in ("red", "green", "blue") for c in outputs[-1].outputs)
    assert runner.num_compiles == compiled
    assert not events, f"JAX compiled while serving: {dict(events)}"

    # The check can fail: a shape outside the buckets compiles, and both counters see it.
    with jax_compile_events() as events:
        runner.step_fns.get((3, 4))
    assert runner.num_compiles == compiled + 1
    assert events[BACKEND_COMPILE_EVENT] >= 1


def test_every_bucket_updates_the_kv_cache_in_place(warm_llm):
    """No compiled bucket copies a whole KV cache: it is donated and written by scatters in
    place (a T = 1 bucket used to copy every cache per step). The token history is checked
    in the GPU compile tests, where its shape cannot be mistaken for an index array's."""
    from jaxllm.kernels.gpu_compile import GpuCompileResult, full_cache_copies

    runner = warm_llm.llm_engine.runner
    compiled = runner.step_fns.items()
    assert len(compiled) == runner.step_fns.num_compiles
    for key, fn in compiled:
        result = GpuCompileResult(target="cpu", hlo=fn.as_text(), ptx={}, kernels=[],
                                  memory=fn.memory_analysis())
        assert full_cache_copies(result, runner.kv_caches) == [], key
