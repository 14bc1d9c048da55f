"""Activation capture and steering through the engine, on the tiny random Llama.

Against HF (float32, forward hooks): every site of every layer within 1e-4, through chunked
prefill. Against the engine itself: a preempted and recomputed request captures the same
values, each position once; a steered request's KV blocks never serve a plain one; plain
rows beside a steered one keep their exact tokens; mixing capture, steering and plain
requests compiles nothing after warm-up; bad selectors are ValueErrors naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.research import Ablate, Capture, ResearchConfig, Steer

from hf_hooks import hf_sites
from test_e2e_warmup import jax_compile_events
from tiny_model import greedy, metric_values, token_ids

SITES = ("resid_pre", "attn_out", "mlp_out", "resid_post", "q", "k", "v", "z", "final_norm")
RESEARCH = ResearchConfig(capture_layers=(0, 1), capture_sites=SITES, steer_layers=(0,),
                          ablate_layers=(0,))
HIDDEN = 64


def random_prompts(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 49152, size=n).tolist() for n in lengths]


def capture(**kwargs) -> dict:
    return {"capture": Capture(**kwargs)}


@pytest.fixture(scope="module")
def research_llm(make_tiny_llm):
    # A budget of 16 tokens: the 40-token prompts below prefill in 3 chunks.
    return make_tiny_llm(research=RESEARCH, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    import torch
    import transformers

    # Eager attention: the only one that returns its probabilities (output_attentions).
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_capture_equals_hf_within_1e4_through_chunked_prefill(research_llm, hf_tiny):
    prompts = random_prompts([40, 7], seed=2)
    params = greedy(5, extra_args=capture())
    outs = research_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        computed = prompt + completion.token_ids[:-1]
        acts = completion.activations
        np.testing.assert_array_equal(acts.positions, np.arange(len(computed)))
        ref = hf_sites(hf_tiny, computed)
        # 2 layers x 8 sites + final_norm; q and k are checked by the attention patterns
        assert len(acts.keys()) == 17 and set(ref) == set(acts.keys()) - {
            "layers.0.q", "layers.0.k", "layers.1.q", "layers.1.k"}
        for name in ref:
            assert acts[name].shape == ref[name].shape
            worst = max(worst, float(np.abs(acts[name] - ref[name]).max()))
        assert acts["layers.1.q"].shape == (len(computed), 4, 16)  # 4 heads of 16
        assert acts["layers.1.k"].shape == (len(computed), 2, 16)  # 2 KV heads
    print(f"\ntiny Llama capture vs HF: max abs error {worst:.2e}")
    assert worst <= 1e-4


def test_a_capturing_request_recomputes_a_cached_prefix(research_llm):
    prompt = {"prompt_token_ids": random_prompts([48], seed=5)[0]}
    research_llm.generate([prompt], greedy(1), use_tqdm=False)  # cache the prompt's blocks
    again = research_llm.generate([prompt], greedy(1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # the last block holds the token still to compute
    captured = research_llm.generate([prompt], greedy(3, extra_args=capture()),
                                     use_tqdm=False)[0]
    assert captured.num_cached_tokens == 0
    np.testing.assert_array_equal(captured.outputs[0].activations.positions, np.arange(50))


def test_preempted_requests_capture_the_same_values_once(make_tiny_llm, research_llm):
    # A KV cache of 1.5 sequences at max length (128) against four long requests.
    tight = make_tiny_llm(research=RESEARCH, max_num_batched_tokens=16, max_model_len=128,
                          num_gpu_blocks_override=1 + (3 * 128 // 16) // 2)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([30, 45, 22, 60], seed=1)]
    params = greedy(40, extra_args=capture(layers=(1,), sites=("resid_post",)))
    before = metric_values(tight)["jaxllm:num_preemptions_total"]
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert metric_values(tight)["jaxllm:num_preemptions_total"] > before
    roomy = research_llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(squeezed) == token_ids(roomy)
    for a, b, p in zip(squeezed, roomy, prompts):
        acts_a, acts_b = a.outputs[0].activations, b.outputs[0].activations
        n = len(p["prompt_token_ids"]) + 39
        np.testing.assert_array_equal(acts_a.positions, np.arange(n))
        np.testing.assert_allclose(acts_a["layers.1.resid_post"],
                                   acts_b["layers.1.resid_post"], atol=1e-5)


def test_steered_blocks_never_serve_a_plain_request(research_llm, tiny_llm):
    prompt = {"prompt_token_ids": random_prompts([40], seed=9)[0]}
    v = np.random.default_rng(0).standard_normal(HIDDEN).astype(np.float32)
    steer = {"steer": Steer(0, v, 3.0)}
    steered = research_llm.generate([prompt], greedy(8, extra_args=steer), use_tqdm=False)[0]
    plain = research_llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 0
    reference = tiny_llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == reference.outputs[0].token_ids
    assert steered.outputs[0].token_ids != reference.outputs[0].token_ids
    # The same steer again shares the steered blocks.
    again = research_llm.generate([prompt], greedy(8, extra_args={"steer": Steer(0, v, 3.0)}),
                                  use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == steered.outputs[0].token_ids


def test_plain_rows_beside_steered_ones_keep_their_exact_tokens(research_llm, tiny_llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([12, 20, 9, 15], seed=4)]
    v = np.random.default_rng(1).standard_normal(HIDDEN).astype(np.float32)
    params = [greedy(16), greedy(16, extra_args={"steer": Steer(0, v, 5.0)}),
              SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
              greedy(16, extra_args={"steer": Steer(0, -v, 2.0)})]
    mixed = research_llm.generate(prompts, params, use_tqdm=False)
    alone = tiny_llm.generate([prompts[0], prompts[2]], [params[0], params[2]], use_tqdm=False)
    assert token_ids([mixed[0], mixed[2]]) == token_ids(alone)


def test_head_ablation_matches_an_hf_hook_and_spares_plain_rows(research_llm, tiny_llm,
                                                                 hf_tiny):
    import torch

    prompts = [{"prompt_token_ids": p} for p in random_prompts([14, 10], seed=12)]
    mean = np.random.default_rng(2).standard_normal((1, 16)).astype(np.float32)
    ablate = {"ablate": Ablate(0, heads=(0, 2)), **capture(layers=(0, 1), sites=("z",
                                                                                 "resid_post"))}
    mean_ablate = {"ablate": Ablate(0, heads=(3,), mean=mean),
                   **capture(layers=(0,), sites=("z",))}
    outs = research_llm.generate(prompts + prompts[:1], [greedy(6, extra_args=ablate),
                                                         greedy(6), greedy(6, extra_args=
                                                                           mean_ablate)],
                                 use_tqdm=False)
    plain = tiny_llm.generate(prompts[1:], greedy(6), use_tqdm=False)
    assert outs[1].outputs[0].token_ids == plain[0].outputs[0].token_ids
    z = outs[0].outputs[0].activations["layers.0.z"]
    assert np.all(z[:, [0, 2]] == 0) and np.abs(z[:, [1, 3]]).max() > 0
    z_mean = outs[2].outputs[0].activations["layers.0.z"]
    np.testing.assert_array_equal(z_mean[:, 3], np.broadcast_to(mean[0], z_mean[:, 3].shape))

    def zero_heads(module, args):
        x = args[0].clone().reshape(*args[0].shape[:2], 4, 16)
        x[:, :, [0, 2]] = 0
        return (x.reshape(args[0].shape),)

    hook = hf_tiny.model.layers[0].self_attn.o_proj.register_forward_pre_hook(zero_heads)
    try:
        computed = prompts[0]["prompt_token_ids"] + outs[0].outputs[0].token_ids[:-1]
        ref = hf_sites(hf_tiny, computed)
        with torch.no_grad():
            ids = torch.tensor([prompts[0]["prompt_token_ids"]])
            gen = hf_tiny.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
    finally:
        hook.remove()
    assert outs[0].outputs[0].token_ids == gen[0, ids.shape[1]:].tolist()
    np.testing.assert_allclose(outs[0].outputs[0].activations["layers.1.resid_post"],
                               ref["layers.1.resid_post"], atol=1e-4)
    # An ablated request's blocks are cached under its ablation: a plain one misses them.
    again = research_llm.generate(prompts[:1], greedy(6), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0


def test_mixed_research_requests_compile_nothing_after_warmup(make_tiny_llm):
    llm = make_tiny_llm(research=RESEARCH, max_num_seqs=4, max_num_batched_tokens=32,
                        max_model_len=64, enforce_eager=False)
    runner = llm.llm_engine.runner
    compiled = runner.num_compiles
    v = np.ones(HIDDEN, np.float32)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([20, 5, 33, 11, 8], seed=7)]
    params = [greedy(6, extra_args=capture()), greedy(6),
              greedy(6, extra_args={"steer": Steer(0, v, 1.5), **capture(positions="generated")}),
              greedy(6, extra_args={"steer": Steer(0, v, -1.0), "ablate": Ablate(0, (1,))}),
              greedy(6, extra_args=capture(layers=[1], positions=[0, 3]))]
    with jax_compile_events() as events:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert runner.num_compiles == compiled
    assert sum(events.values()) == 0, dict(events)
    assert [len(o.outputs[0].activations or ()) for o in outs] == [25, 0, 5, 0, 2]


@pytest.mark.parametrize("extra_args, message", [
    (capture(layers=(5,)), r"extra_args\['capture'\]\.layers must be among the engine's "
                           r"capture_layers \[0, 1\], got 5"),
    (capture(sites=("logits",)), r"extra_args\['capture'\]\.sites must be among"),
    (capture(positions="middle"), r"extra_args\['capture'\]\.positions must be one of "
                                  r"\['all', 'prompt', 'generated'\]"),
    (capture(positions=[-1]), r"extra_args\['capture'\]\.positions must be >= 0"),
    ({"steer": Steer(1, np.zeros(HIDDEN))}, r"extra_args\['steer'\]\.layer must be among "
                                            r"the engine's steer_layers \[0\], got 1"),
    ({"steer": Steer(0, np.zeros(3))}, r"extra_args\['steer'\]\.vector must have shape "
                                       r"\(64,\)"),
    ({"steer": Steer(0, np.full(HIDDEN, np.inf))}, r"must be finite"),
    ({"steer": [Steer(0, np.zeros(HIDDEN)), Steer(0, np.ones(HIDDEN))]},
     r"extra_args\['steer'\] has two entries for layer 0"),
    ({"capture": "all"}, r"must be a jaxllm.research.Capture"),
    ({"ablate": Ablate(1, (0,))}, r"extra_args\['ablate'\]\.layer must be among the "
                                  r"engine's ablate_layers \[0\], got 1"),
    ({"ablate": Ablate(0, (0, 4))}, r"extra_args\['ablate'\]\.heads must be distinct heads "
                                    r"in \[0, 4\), got \[0, 4\]"),
    ({"ablate": Ablate(0, (1,), mean=np.zeros((2, 16)))},
     r"extra_args\['ablate'\]\.mean must have shape \(1, 16\)"),
])
def test_bad_research_arguments_are_value_errors(research_llm, extra_args, message):
    with pytest.raises(ValueError, match=message):
        research_llm.generate(["hi"], greedy(2, extra_args=extra_args), use_tqdm=False)
    assert not research_llm.llm_engine.has_unfinished_requests()


def test_an_engine_without_research_refuses_capture_and_steer(tiny_llm):
    with pytest.raises(ValueError, match=r"extra_args\['capture'\] needs an engine that "
                                         r"captures: start it with LLM\(research="):
        tiny_llm.generate(["hi"], greedy(2, extra_args=capture()), use_tqdm=False)
    with pytest.raises(ValueError, match=r"extra_args\['steer'\] needs an engine that steers"):
        tiny_llm.generate(["hi"], greedy(2, extra_args={"steer": Steer(0, np.zeros(HIDDEN))}),
                          use_tqdm=False)
    with pytest.raises(ValueError, match=r"extra_args must be a dict, got list"):
        tiny_llm.generate(["hi"], greedy(2, extra_args=["capture"]), use_tqdm=False)
    # Other keys are left to whoever reads them, as vLLM does.
    out = tiny_llm.generate(["hi"], greedy(2, extra_args={"plugin": 1}), use_tqdm=False)
    assert out[0].outputs[0].activations is None


def test_research_config_is_checked_against_the_model(make_tiny_llm):
    with pytest.raises(ValueError, match=r"research\.capture_layers must be in \[0, 2\)"):
        make_tiny_llm(research=ResearchConfig(capture_layers=(2,)))
    with pytest.raises(ValueError, match=r"research\.capture_sites must be among"):
        ResearchConfig(capture_sites=("logits",))


def test_logit_lens_and_attention_patterns_match_hf(research_llm, hf_tiny):
    import torch

    from jaxllm.research.lens import attention_pattern, logit_lens

    prompt = random_prompts([21], seed=11)[0]
    out = research_llm.generate([{"prompt_token_ids": prompt}], greedy(4, extra_args=capture()),
                                use_tqdm=False)[0].outputs[0]
    acts = out.activations
    computed = prompt + out.token_ids[:-1]
    # The lens of the last layer's stream is the model's own next-token choice.
    final = logit_lens(research_llm, acts["final_norm"], final_norm=False)
    np.testing.assert_allclose(logit_lens(research_llm, acts["layers.1.resid_post"]), final,
                               atol=1e-5)
    assert final[len(prompt) - 1:].argmax(-1).tolist() == out.token_ids
    # Layer 0's lens against HF's norm and LM head on HF's own layer-0 output.
    with torch.no_grad():
        ids = torch.tensor([computed])
        hidden = hf_tiny.model(ids, output_hidden_states=True).hidden_states[1]
        ref = hf_tiny.lm_head(hf_tiny.model.norm(hidden))[0].numpy()
        hf_pattern = hf_tiny(ids, output_attentions=True).attentions[1][0].numpy()
    np.testing.assert_allclose(logit_lens(research_llm, acts["layers.0.resid_post"]), ref,
                               atol=1e-4)
    pattern = attention_pattern(research_llm, 1, acts["layers.1.resid_pre"])
    assert pattern.shape == (4, len(computed), len(computed))
    np.testing.assert_allclose(pattern, hf_pattern, atol=1e-5)
    # The captured q and k (after RoPE) give the same pattern.
    q, k = acts["layers.1.q"], np.repeat(acts["layers.1.k"], 2, axis=1)
    scores = np.einsum("qnh,knh->nqk", q, k) / np.sqrt(16)
    scores = np.where(np.tril(np.ones(scores.shape[1:], bool)), scores, -np.inf)
    from_qk = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(from_qk / from_qk.sum(-1, keepdims=True), hf_pattern, atol=1e-5)
    np.testing.assert_allclose(pattern.sum(-1), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match=r"hidden_PD must have shape \[P, 64\]"):
        logit_lens(research_llm, np.zeros((3, 5)))


def test_async_llm_streams_captures_with_its_outputs(tiny_model_dir, research_llm):
    import asyncio

    from jaxllm import AsyncEngineArgs, AsyncLLM
    from tiny_model import SMALL

    args = {k: v for k, v in SMALL.items() if k != "use_tqdm_on_load"}
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=tiny_model_dir, research=RESEARCH,
                                                       **args))
    prompt = {"prompt_token_ids": random_prompts([9], seed=13)[0]}
    params = greedy(5, extra_args=capture(layers=(1,), sites=("resid_post",)))

    async def stream():
        return [out async for out in engine.generate(prompt, params, "cap-1")]

    try:
        outs = asyncio.run(stream())
    finally:
        engine.shutdown()
    final = outs[-1].outputs[0]
    offline = research_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert final.token_ids == offline.token_ids
    np.testing.assert_array_equal(final.activations.positions, np.arange(13))
    np.testing.assert_allclose(final.activations["layers.1.resid_post"],
                               offline.activations["layers.1.resid_post"], atol=1e-5)
