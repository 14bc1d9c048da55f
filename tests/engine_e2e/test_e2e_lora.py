"""LoRA end to end (jaxllm/lora/): random PEFT adapters (B != 0) on tiny random Llama and
Qwen2 models against HF transformers + peft in float32, batches mixing adapters, the
max_loras limit, the prefix cache per adapter, and the refusals.

One LoRA engine per model (module scope): max_loras=3, max_cpu_loras=3 (so a 4th adapter
also exercises the host LRU), logits as logprobs (logprobs_mode="raw_logits") for the
comparison with the merged model's.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineConfig
from jaxllm.lora.request import LoRARequest
from lora_adapters import merged, write_peft_adapter
from tiny_model import SMALL, TINY_CONFIG, build_tiny_hf_dir, greedy

VOCAB = 512
PROMPTS = [[1, 500, 60, 70, 42, 99], [7, 8, 9, 10, 11, 12, 300, 301]]
# Tiny budgets: compiling a token bucket is the slow part of these tests, and with 4 tokens
# a step (prompts prefilled in chunks) every step runs in bucket 2 or 4; Qwen2's engine, 2
# tokens and 2 sequences, only ever runs bucket 2.
LORA_ENGINE = dict(SMALL, enable_lora=True, max_loras=3, max_cpu_loras=3, max_num_seqs=4,
                   max_num_batched_tokens=4, logprobs_mode="raw_logits")
ADAPTERS = {  # name: (id, write_peft_adapter arguments)
    "all8": (1, dict(seed=1, r=8)),
    "attn16_rslora": (2, dict(seed=2, r=16, lora_alpha=8, use_rslora=True,
                              target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))),
    "mlp4": (3, dict(seed=3, r=4, target_modules=("gate_proj", "up_proj", "down_proj"))),
    "all8b": (4, dict(seed=4, r=8)),
}


class Setup:
    def __init__(self, root, config_cls, arch, loras=ADAPTERS, engine=None, **config):
        self.hf = build_tiny_hf_dir(f"{root}/model", config_cls, arch, vocab_size=VOCAB,
                                    **{**TINY_CONFIG, **config})
        self.peft, self.lora = {}, {}
        for name, (lid, kwargs) in loras.items():
            self.peft[name] = write_peft_adapter(self.hf, f"{root}/{name}", **kwargs)
            self.lora[name] = LoRARequest(name, lid, f"{root}/{name}")
        self.llm = LLM(f"{root}/model", **{**LORA_ENGINE, **(engine or {})})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("lora_llama"), "LlamaConfig", "LlamaForCausalLM")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("lora_qwen2"), "Qwen2Config", "Qwen2ForCausalLM",
                 loras={"all8": ADAPTERS["all8"]},
                 engine=dict(max_num_seqs=2, max_num_batched_tokens=2))


def hf_greedy(model, ids, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_parity(setup: Setup, name: str, n: int = 6) -> float:
    """Greedy tokens equal HF + peft's; -> the largest |logit - merged model's logit| over the
    top-5 logits of every generated position."""
    import torch

    outs = setup.llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                              greedy(n, logprobs=5), use_tqdm=False,
                              lora_request=setup.lora[name])
    reference = merged(setup.peft[name])
    worst = 0.0
    for ids, out in zip(PROMPTS, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(setup.peft[name], ids, n), name
        with torch.no_grad():
            logits = reference(torch.tensor([ids + tokens])).logits[0].numpy()
        for i, lp in enumerate(out.outputs[0].logprobs):
            row = logits[len(ids) - 1 + i]
            for tok, value in lp.items():
                worst = max(worst, abs(value.logprob - float(row[tok])))
    return worst


@pytest.mark.parametrize("name", ["all8", "attn16_rslora", "mlp4"])
def test_llama_adapter_matches_hf_peft(llama, name):
    worst = check_parity(llama, name)
    print(f"\nLlama {name}: max |dlogit| vs merged = {worst:.2e}")
    assert worst < 1e-4


def test_qwen2_adapter_matches_hf_peft(qwen2, name="all8"):
    worst = check_parity(qwen2, name)
    print(f"\nQwen2 {name}: max |dlogit| vs merged = {worst:.2e}")
    assert worst < 1e-4


def test_one_cpu_device_runs_the_cpu_kernel(llama):
    """The parity and mixed-batch tests here check the C++ kernel (lora/apply.py) wherever it
    can run; tests/parallel/test_tp_lora.py checks the XLA way under tensor parallelism."""
    import jax

    from jaxllm.kernels import cpu_lora
    from jaxllm.lora.apply import cpu_apply
    feature = llama.llm.llm_engine.lora_manager.feature
    table_dtype = next(iter(feature.tables.values()))[0].dtype
    if jax.default_backend() != "cpu" or not cpu_lora.availability(table_dtype):
        pytest.skip("the C++ LoRA kernel runs on an AVX-512 cpu platform")
    assert feature.apply is cpu_apply


def test_base_model_is_unchanged(llama):
    out = llama.llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(6), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(llama.hf, PROMPTS[0], 6)


def test_mixed_batch_gives_each_request_its_tokens_alone(llama):
    """3 adapters and the base model in one batch (decoding together; prefilled in chunks
    that mix them too), each request exactly as when it runs alone."""
    names = ["all8", "attn16_rslora", None, "mlp4"]
    loras = [llama.lora[n] if n else None for n in names]
    prompts = [{"prompt_token_ids": PROMPTS[0]}] * len(names)
    together = llama.llm.generate(prompts, greedy(6), use_tqdm=False, lora_request=loras)
    alone = [llama.llm.generate(p, greedy(6), use_tqdm=False, lora_request=lr)[0]
             for p, lr in zip(prompts, loras)]
    got = [o.outputs[0].token_ids for o in together]
    assert got == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(t) for t in got}) == 4  # every adapter changes the output


def test_a_fourth_adapter_waits_for_a_slot_and_finishes(llama):
    engine = llama.llm.llm_engine
    names = ["all8", "attn16_rslora", "mlp4", "all8b"]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 4 * (i < 3), ignore_eos=True,
                             extra_args=None) for i in range(4)]
    from jaxllm.lora.manager import apply_lora_requests
    from jaxllm.lora.request import lora_request_of

    params = apply_lora_requests(params, [llama.lora[n] for n in names])
    ids = engine.add_requests([_prompt(PROMPTS[0])] * 4, params)
    waited, outputs = False, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        running = {lora_request_of(r.sampling_params).lora_name
                   for r in engine.scheduler.running}
        assert len(running) <= 3
        waiting = {lora_request_of(r.sampling_params).lora_name
                   for r in engine.scheduler.waiting}
        if "all8b" in waiting:  # (others may wait for the 8-token budget)
            waited = True  # vLLM's gauge says so too
            info, = [m for m in engine.get_metrics() if m.name == "jaxllm:lora_requests_info"]
            assert info.labels == {"max_lora": "3",
                                   "waiting_lora_adapters": ",".join(sorted(waiting)),
                                   "running_lora_adapters": ",".join(sorted(running))}
    assert waited
    assert [len(outputs[i].outputs[0].token_ids) for i in ids] == [8, 8, 8, 4]
    alone = llama.llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(4), use_tqdm=False,
                               lora_request=llama.lora["all8b"])
    assert outputs[ids[3]].outputs[0].token_ids == alone[0].outputs[0].token_ids


def _prompt(ids):
    from jaxllm.engine.processor import PromptInput

    return PromptInput(None, list(ids))


def test_prefix_cache_is_never_shared_across_adapters(llama):
    prompt = {"prompt_token_ids": list(range(100, 120))}  # 1 full block of 16
    llm = llama.llm
    first = llm.generate(prompt, greedy(2), use_tqdm=False, lora_request=llama.lora["all8"])
    assert first[0].num_cached_tokens == 0
    for lora in (llama.lora["mlp4"], None):
        out = llm.generate(prompt, greedy(2), use_tqdm=False, lora_request=lora)
        assert out[0].num_cached_tokens == 0, lora
    again = llm.generate(prompt, greedy(2), use_tqdm=False, lora_request=llama.lora["all8"])
    assert again[0].num_cached_tokens == 16  # the same adapter does reuse its block
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def _adapter_dir(path, config, bin_only=False):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                   "target_modules": ["q_proj"], **config}, f)
    if bin_only:
        open(os.path.join(path, "adapter_model.bin"), "wb").close()
    return str(path)


def test_bad_adapters_are_value_errors_naming_adapter_and_field(llama, tmp_path):
    llm, p = llama.llm, {"prompt_token_ids": PROMPTS[0]}
    cases = [
        (_adapter_dir(tmp_path / "big", {"r": 32}), "r"),
        (_adapter_dir(tmp_path / "lm", {"target_modules": ["lm_head"]}), "target_modules"),
        (_adapter_dir(tmp_path / "bin", {}, bin_only=True), "adapter_model.bin"),
        (str(tmp_path / "missing"), "adapter_config.json"),
    ]
    for i, (path, field) in enumerate(cases):
        with pytest.raises(ValueError, match=field) as e:
            llm.generate(p, greedy(1), use_tqdm=False,
                         lora_request=LoRARequest(f"bad{i}", 100 + i, path))
        assert f"bad{i}" in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate([p, p], greedy(1), use_tqdm=False, lora_request=[llama.lora["all8"]])


def test_engine_argument_checks():
    for kwargs, field in [(dict(max_loras=0), "max_loras"), (dict(max_lora_rank=7),
                          "max_lora_rank"), (dict(max_loras=4, max_cpu_loras=2),
                          "max_cpu_loras"), (dict(lora_dtype="int8"), "lora_dtype"),
                          (dict(enable_lora=1), "enable_lora")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")


def test_disabled_engine_refuses_an_adapter(tiny_llm, llama):
    with pytest.raises(ValueError, match="enable_lora"):
        tiny_llm.generate("Hi", greedy(1), use_tqdm=False, lora_request=llama.lora["all8"])
    assert np.all([f.name != "lora" for f in tiny_llm.llm_engine.runner.features])
