"""Tensor parallelism on an 8-GPU H100 node, proven without a GPU: the runner's step for a
TP=8 mesh of compile-only H100 devices (jaxllm/kernels/gpu_compile.py) goes through XLA's
real GPU pipeline, and each device's program holds

  * the Pallas kernel once per layer, on its own KV head (grid axis 1 = KV heads / 8 = 1),
    clean (no spill, shared memory and registers within the H100's limits, tensor cores);
  * its caches updated in place (no whole-cache copy with one KV head per device);
  * 2 * layers + 1 activation all-reduces, in the model's dtype (bf16: the bytes of vLLM's
    RowParallelLinear, not f32 partial sums), and 2 logits all-gathers, nothing else.

The model has Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128) in two
layers of smaller width, to keep the compile short; benchmarks/tp_plan.py compiles the full
Llama-3-8B and 70B shapes and reports memory and collective bytes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs jax-cuda12-plugin (gpu-compile extra)")


from jaxllm.kernels import gpu_compile as gc  # noqa: E402
from jaxllm.kernels import hlo_text, tuning  # noqa: E402
from jaxllm.kernels.backends import get_backend  # noqa: E402
from jaxllm.models.config import ModelConfig  # noqa: E402
from jaxllm.models.sharding import make_mesh  # noqa: E402
from jaxllm.runner.abstract_step import lower_abstract_step  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.gpu_compile]

CFG = ModelConfig.from_hf_config(dict(
    architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=1024,
    intermediate_size=2048, num_hidden_layers=2, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128))
T, S, W = 64, 64, 128


@pytest.fixture(scope="module")
def compiled(request):
    mp = pytest.MonkeyPatch()
    mp.setattr(tuning, "detect_target", lambda: "h100")  # the tiles that GPU would pick
    try:
        mesh = make_mesh(8, gc.target_devices("h100", 8))
        step = lower_abstract_step(CFG, mesh, get_backend("pallas"), T=T, S=S, W=W,
                                   num_blocks=4096, max_num_seqs=S)
        return step, gc.compile_lowered(step.lowered, "h100")
    finally:
        mp.undo()


def test_each_device_runs_the_kernel_on_its_own_kv_head(compiled):
    step, result = compiled
    kernels = [k for k in result.kernels if k.name.startswith("ragged_paged")]
    assert len(kernels) == CFG.num_hidden_layers
    for kernel in kernels:
        assert kernel.grid[1] == 1  # KV heads on this device: 8 / 8
        assert gc.kernel_problems(result, kernel) == []
    cache = step.kv_caches[0][0]
    assert cache.sharding.shard_shape(cache.shape) == (4096, 16, 1, 128)


def test_caches_are_updated_in_place(compiled):
    step, result = compiled
    assert gc.full_cache_copies(result, step.kv_caches) == []


def test_collectives_are_activation_reduces_and_logit_gathers(compiled):
    _, result = compiled
    found = hlo_text.collectives(result.hlo)
    assert sorted(c.op for c in found) == ["all-gather"] * 2 + ["all-reduce"] * 5
    assert {(c.dtype, c.shape) for c in found if c.op == "all-reduce"} == \
        {("bf16", (T, CFG.hidden_size))}
    assert sorted((c.shape, c.in_entry) for c in found if c.op == "all-gather") == \
        sorted([((S, CFG.vocab_size), True), ((T, CFG.vocab_size), False)])
