"""The Pallas kernel inside the whole model step, the way the engine launches it.

Tier 1: a full greedy run of a tiny model through "pallas_interpret" gives the XLA path's
        tokens (engine end to end: scheduler, buckets, donated cache, sampler).
Tier 2: `jax.export(..., platforms=["cuda"])` of the runner's jitted step for every bucket an
        engine config can launch (the kernel variant is a function of the bucket's shapes).
Tier 3: the same step compiled for H100 and A100 (jaxllm/kernels/targets): a small model and
        one layer shaped like Llama-3-8B; no full KV-cache copy, clean kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.kernels import paged_attention as pa
from jaxllm.kernels import tuning
from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.parallel import ParallelOps
from jaxllm.runner.buckets import BucketConfig
from jaxllm.runner.step import abstract_inputs, make_step_fn
from engine_e2e.tiny_model import build_tiny_llama_dir  # noqa: E402

pytestmark = pytest.mark.slow

# head_dim 64: a size the kernel supports; 4 query heads over 2 KV heads (GQA group 2).
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny64")), **TINY)


def test_pallas_interpret_greedy_matches_xla(tiny_dir):
    prompts = [[100 + i for i in range(n)] for n in (3, 17, 40)]  # cross 16-token blocks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for backend in ("xla", "pallas_interpret"):
        # float32: the two backends' tokens can only be compared exactly there.
        llm = LLM(tiny_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=128,
                  enforce_eager=True, use_tqdm_on_load=False, attention_backend=backend)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[backend] = [o.outputs[0].token_ids for o in outs]
    # The 40-token prompt is chunked over two steps (budget 32): a chunk over a cached prefix.
    assert runs["pallas_interpret"] == runs["xla"]


def _small_cfg(**kw) -> ModelConfig:
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=512, intermediate_size=256,
                num_hidden_layers=2, max_position_embeddings=1024, **TINY)
    return ModelConfig.from_hf_config({**base, **kw})


def _step_specs(cfg: ModelConfig, T, S, W, num_blocks, dtype):
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cache = jax.ShapeDtypeStruct((num_blocks, 16, cfg.num_key_value_heads, cfg.head_dim), dtype)
    caches = [(cache, cache) for _ in range(cfg.num_hidden_layers)]
    # [slots, max_model_len]: more slots than the bucket's S, as when a step runs fewer
    # sequences than max_num_seqs (then a row gather is told apart from a full pass).
    token_history = jax.ShapeDtypeStruct((S + 8, W * 16), jnp.int32)
    return make_step_fn(graphdef, ParallelOps.single_device("pallas")), (
        state, caches, token_history, *abstract_inputs(T, S, W))


ENGINE_BUCKETS = BucketConfig.create(max_num_batched_tokens=256, max_num_seqs=32,
                                     max_blocks_per_seq=64, bucket_widths=False)


def test_engine_buckets_cover_every_kernel_variant():
    cfg = _small_cfg()
    seen = set()
    for T, S, W in ENGINE_BUCKETS.all_shapes():
        plan = pa.plan((T, cfg.num_attention_heads, cfg.head_dim),
                       (1024, 16, cfg.num_key_value_heads, cfg.head_dim), (S, W), jnp.bfloat16,
                       target="h100")
        seen.add(repr(plan)[:60])
    assert len(seen) >= 2  # decode-heavy and prefill tiles both launched by some bucket


@pytest.mark.parametrize("shape", ENGINE_BUCKETS.all_shapes(), ids=lambda s: "T%dS%dW%d" % s)
def test_whole_step_exports_for_cuda(shape):
    step, specs = _step_specs(_small_cfg(), *shape, num_blocks=1024, dtype=jnp.bfloat16)
    exported = jax.export.export(
        step, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*specs)
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text  # the Pallas kernel, not an XLA fallback
    assert exported.platforms == ("cuda",)


def _compile_step(monkeypatch, target, cfg, T, S, W, num_blocks):
    from jaxllm.kernels import gpu_compile as gc

    # What tuning.detect_target() returns on that GPU, so the step uses the target's tiles.
    monkeypatch.setattr(tuning, "detect_target", lambda: target)
    step, specs = _step_specs(cfg, T, S, W, num_blocks, jnp.bfloat16)
    result = gc.compile_for_target(step, specs, target)
    assert gc.full_cache_copies(result, specs[1]) == []
    assert gc.full_cache_copies(result, [specs[2]]) == []  # the token history, too
    kernels = [k for k in result.kernels if k.name.startswith("ragged_paged")]
    assert len(kernels) == cfg.num_hidden_layers
    for k in kernels:
        assert gc.kernel_problems(result, k) == []
    return result


@pytest.mark.gpu_compile
@pytest.mark.parametrize("target", ["h100", "a100"])
@pytest.mark.parametrize("T,S", [(32, 32), (256, 8)], ids=["decode", "prefill"])
def test_small_model_step_compiles_for_gpu(monkeypatch, target, T, S):
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    _compile_step(monkeypatch, target, _small_cfg(), T, S, 64, num_blocks=1024)


@pytest.mark.gpu_compile
@pytest.mark.parametrize("target", ["h100", "a100"])
def test_llama3_8b_layer_step_compiles_for_gpu(monkeypatch, target):
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    # One Llama-3-8B layer (real widths, vocab and rope scaling); 64 decode sequences x 2k.
    cfg = ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0,
                                               low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=8192)))
    result = _compile_step(monkeypatch, target, cfg, 64, 64, 128, num_blocks=8192)
    print(target, [(k.name, k.registers, k.spill_store_bytes, k.shared_memory_bytes)
                   for k in result.kernels if k.name.startswith("ragged_paged")])
