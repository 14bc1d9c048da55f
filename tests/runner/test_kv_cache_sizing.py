"""KV cache sizing on an accelerator, from the compiled step's temporaries (runner/kv_cache.py).

The arithmetic and its errors on exact numbers, then a Llama-3-8B-shaped model on a fake
device: the real ModelRunner over abstract weights (nothing is allocated), its largest bucket
compiled for the profile, and the budget checked against XLA's own accounting of the
compiled steps at the final block count.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from jaxllm.kernels.backends import get_backend
from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.sharding import make_mesh
from jaxllm.runner.buckets import BucketConfig
from jaxllm.runner.kv_cache import (STEPS_IN_FLIGHT, DeviceMemory, KVCacheSizing, StepMemory,
                                    determine_num_blocks, device_memory, flat_margin_kv_bytes,
                                    kv_bytes_per_block, needs_profile, per_device_bytes,
                                    provisional_num_blocks, size_from_profile)
from jaxllm.runner.model_runner import ModelRunner

GiB = 1 << 30


@dataclasses.dataclass
class FakeDevice:
    platform: str
    stats: dict | None

    def memory_stats(self):
        return self.stats


def test_device_memory_is_the_tightest_device_or_none():
    gpus = [FakeDevice("gpu", {"bytes_limit": 100, "bytes_in_use": 10}),
            FakeDevice("gpu", {"bytes_limit": 90, "bytes_in_use": 5})]
    assert device_memory(gpus) == DeviceMemory(bytes_limit=90, bytes_in_use=10)
    assert device_memory([FakeDevice("gpu", {"bytes_limit": 7})]) == DeviceMemory(7, 0)
    assert device_memory([FakeDevice("cpu", {"bytes_limit": 100})]) is None  # CPU default
    assert device_memory([FakeDevice("gpu", {"bytes_in_use": 3})]) is None  # no limit
    assert device_memory([FakeDevice("gpu", None)]) is None
    assert device_memory([]) is None
    assert device_memory(jax.devices()) is None  # this CPU


def _llama3_8b(layers: int = 32) -> ModelConfig:
    return ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rope_theta=500000.0))


def test_bytes_per_block_are_per_device():
    cfg = _llama3_8b()
    # 2 (K, V) x 32 layers x 16 tokens x 8 KV heads x 128 x 2 bytes = 2 MiB.
    assert kv_bytes_per_block(cfg, 16, jnp.bfloat16) == 2 << 20
    assert kv_bytes_per_block(cfg, 16, jnp.bfloat16, tp=2) == 1 << 20
    assert kv_bytes_per_block(cfg, 16, jnp.bfloat16, tp=8) == 256 << 10
    # The config must be the model's as laid out for tp (its KV heads a multiple of tp).
    with pytest.raises(ValueError, match="num_key_value_heads=8 is not a multiple of tp=3"):
        kv_bytes_per_block(cfg, 16, jnp.bfloat16, tp=3)


def test_step_memory_from_xla_accounting():
    @dataclasses.dataclass
    class Analysis:  # the fields of jax's CompiledMemoryStats that StepMemory reads
        argument_size_in_bytes: int
        output_size_in_bytes: int
        alias_size_in_bytes: int
        temp_size_in_bytes: int

    # Arguments 1000, of which 900 persist; outputs 500, of which 450 donated back.
    m = StepMemory.of(Analysis(1000, 500, 450, 70), persistent_bytes=900)
    assert (m.temp_bytes, m.io_bytes, m.reserve_bytes) == (70, 150, 370)
    assert StepMemory.of(None, 900) is None


def test_per_device_bytes_count_shards():
    mesh = make_mesh(1)
    spec = jax.ShapeDtypeStruct((4, 16, 8, 128), jnp.bfloat16,
                                sharding=jax.sharding.NamedSharding(
                                    mesh, jax.sharding.PartitionSpec(None, None, "tp", None)))
    assert per_device_bytes([spec, jnp.zeros((3, 5), jnp.int32)]) == 4 * 16 * 8 * 128 * 2 + 60


def test_sizing_arithmetic():
    config = EngineConfig(gpu_memory_utilization=0.5)
    memory = DeviceMemory(bytes_limit=10_000, bytes_in_use=1_000)
    assert needs_profile(config, memory)
    assert provisional_num_blocks(config, memory, 300) == 13  # (5000 - 1000) // 300
    sizing = size_from_profile(config, memory, 300, {(64, 8): StepMemory(700, 50),
                                                     (2, 8): StepMemory(800, 40),
                                                     (8, 8): None})
    # budget 5000 - in use 1000 - the largest reserve 800 + 2 x 40 = 3120 -> 10 blocks.
    assert sizing == KVCacheSizing(
        budget_bytes=5000, in_use_bytes=1000, reserved_bytes=880,
        reserved_for="bucket (2, 8): temporaries 800 + 2 x inputs/outputs 40 bytes, XLA's "
                     "memory analysis", bytes_per_block=300, num_blocks=10)
    assert sizing.kv_bytes == 3000
    assert determine_num_blocks(config, _llama3_8b(1), jnp.bfloat16, sizing=sizing) == 10
    assert sizing.describe().startswith("KV cache sizing (per device): budget 0.00 GiB; ")


def test_the_config_overrides_the_device():
    cfg, memory = _llama3_8b(1), DeviceMemory(100 * GiB, GiB)
    per_block = kv_bytes_per_block(cfg, 16, jnp.bfloat16)  # 64 KiB
    sizing = size_from_profile(EngineConfig(), memory, per_block, {(2, 1): StepMemory(0, 0)})
    for config, want in [(EngineConfig(num_gpu_blocks_override=7), 7),
                         (EngineConfig(kv_cache_memory_bytes=5 << 20), 80),
                         (EngineConfig(), sizing.num_blocks)]:
        assert needs_profile(config, memory) == (want == sizing.num_blocks)
        assert determine_num_blocks(config, cfg, jnp.bfloat16, sizing=sizing) == want
    # No accelerator memory: the CPU default, exactly as before.
    assert not needs_profile(EngineConfig(), None)
    assert determine_num_blocks(EngineConfig(), cfg, jnp.bfloat16) == \
        CPU_DEFAULT_KV_CACHE_BYTES // per_block


def test_a_bucket_over_the_reservation_is_refused_or_warned():
    sizing = KVCacheSizing(budget_bytes=5000, in_use_bytes=1000, reserved_bytes=900,
                           reserved_for="bucket (64, 8)", bytes_per_block=300, num_blocks=10)
    sizing.check({(64, 8): StepMemory(800, 50), (2, 8): StepMemory(100, 0), (4, 8): None})
    assert sizing.excess({(64, 8): StepMemory(900, 0), (2, 8): StepMemory(900, 50),
                          (4, 8): StepMemory(1500, 0)}) == {(2, 8): 100, (4, 8): 600}
    with pytest.raises(RuntimeError) as err:
        sizing.check({(2, 8): StepMemory(1000, 0), (4, 8): StepMemory(1400, 50)})
    assert str(err.value) == (
        "the compiled step for bucket (4, 8) needs 1500 bytes of temporaries and "
        "inputs/outputs, 600 more than the 900 reserved (bucket (64, 8)); with the KV cache "
        "at 3000 bytes it would run out of device memory. Set kv_cache_memory_bytes <= 2400 "
        "or lower gpu_memory_utilization.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sizing.warn_if_over((2, 8), StepMemory(900, 0))
        sizing.warn_if_over((2, 8), None)
    with pytest.warns(RuntimeWarning, match=r"bucket \(2, 8\) needs 901 bytes"):
        sizing.warn_if_over((2, 8), StepMemory(899, 1))


def test_no_memory_analysis_reserves_the_flat_margin_and_says_so():
    config, memory = EngineConfig(), DeviceMemory(bytes_limit=10_000, bytes_in_use=1_000)
    with pytest.warns(RuntimeWarning, match="no memory analysis on this platform"):
        sizing = size_from_profile(config, memory, 100, {(64, 8): None})
    # free 9000 - 1000 = 8000; 90% of it for the cache.
    assert flat_margin_kv_bytes(memory, 0.9) == 7200
    assert (sizing.reserved_bytes, sizing.num_blocks, sizing.reserved_for) == (
        800, 72, "flat 10% margin")


# ---- a Llama-3-8B-shaped model on a fake device -------------------------------------------

# JAX's allocator takes 0.75 of a GPU by default (XLA_PYTHON_CLIENT_MEM_FRACTION): an 80 GiB
# H100 reports bytes_limit = 60 GiB.
H100_BYTES_LIMIT = 60 * GiB
LAYERS = 2  # compiled; the other 30 of the 32 count as loaded (below)


def _nbytes(tree) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _report(sizing: KVCacheSizing, memory: DeviceMemory, what: str) -> int:
    """Print the figures beside a flat 10% margin's; -> the bytes the flat margin would
    leave unused with this step's needs (negative: over the budget)."""
    flat_kv = flat_margin_kv_bytes(memory, 0.9)
    unused = sizing.budget_bytes - (memory.bytes_in_use + flat_kv + sizing.reserved_bytes)
    print(f"\n{what}: {sizing.describe()}\n  flat margin: KV {flat_kv / GiB:.2f} GiB, "
          f"{'unused' if unused >= 0 else 'OVER BUDGET'} {abs(unused) / GiB:.2f} GiB "
          f"({abs(unused) // sizing.bytes_per_block} blocks)")
    return unused


def test_llama3_8b_sizing_fits_the_budget_on_a_fake_h100():
    """The engine's runner for Llama-3-8B widths at the accelerator defaults (max_num_seqs
    256, max_num_batched_tokens 8192, max_model_len 8192) over abstract weights, sized as
    the engine does for the whole 32-layer model: the device holds the compiled layers'
    weights, the 30 left out (as if loaded) and the token history; a block holds 32 layers.
    The step's needs are the compiled model's. Compiled for a GPU they do not depend on the
    layer count (751.5 MiB of temporaries at T = 8192 for 1, 2 and 32 layers); on XLA:CPU
    they grow with it (1.9 GiB at 2 layers, 9.5 GiB at 32)."""
    config = EngineConfig(max_model_len=8192).resolved(8192, on_accelerator=True)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(_llama3_8b(LAYERS), dtype=jnp.bfloat16,
                                                    rngs=nnx.Rngs(0)))
    layer_bytes = _nbytes(nnx.state(model.model.layers[0]))
    buckets = BucketConfig.create(config.max_num_batched_tokens, config.max_num_seqs,
                                  config.max_model_len // config.block_size,
                                  bucket_widths=False)
    runner = ModelRunner(model, num_blocks=0, block_size=config.block_size,
                         kv_dtype=jnp.bfloat16, buckets=buckets,
                         attention_backend=get_backend("xla"),
                         max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                         eos_token_ids=(128001,), mesh=make_mesh(1))
    # Weights, the token history and the per-slot tables [R + 1, ...] (runner/device_rows.py):
    # allowed-token bits [257, 4008] int32 and bad words; the 0-block cache holds nothing.
    tables = sum(rows.device.nbytes for rows in runner.slot_rows.values())
    assert runner.slot_rows["allowed_token_bits"].device.shape == (257, 4008)
    assert runner.persistent_bytes() == (_nbytes(runner.state) + runner.token_ids.nbytes
                                         + tables)
    memory = DeviceMemory(bytes_limit=H100_BYTES_LIMIT, bytes_in_use=runner.persistent_bytes()
                          + (32 - LAYERS) * layer_bytes)
    per_block = kv_bytes_per_block(_llama3_8b(), config.block_size, jnp.bfloat16)
    provisional = provisional_num_blocks(config, memory, per_block)
    profile = runner.profile_run(provisional)
    assert list(profile) == [(8192, 512)]  # the largest token bucket, the one width
    sizing = size_from_profile(config, memory, per_block, profile)

    assert sizing.budget_bytes == int(0.9 * H100_BYTES_LIMIT)
    assert sizing.in_use_bytes + sizing.kv_bytes + sizing.reserved_bytes <= sizing.budget_bytes
    assert sizing.budget_bytes - (sizing.in_use_bytes + sizing.kv_bytes
                                  + sizing.reserved_bytes) < sizing.bytes_per_block
    # At the final block count (smaller than the profile's), the largest and the smallest
    # bucket need no more than was reserved (the largest exactly as much: the block count
    # does not change it), so weights + KV + each step's needs fit the budget.
    assert sizing.num_blocks < provisional
    final = runner.profile_run(sizing.num_blocks, keys=[(8192, 512), (2, 512)])
    assert final[8192, 512] == profile[8192, 512]
    assert final[2, 512].reserve_bytes <= sizing.reserved_bytes
    # What XLA counts as arguments beyond weights, KV cache and token history, plus the
    # outputs not donated back: metadata, allowed-token bits, logprobs. Positive and small:
    # the KV cache's per-block bytes are the ones XLA sees.
    assert all(0 < step.io_bytes < 16 << 20 for step in final.values())
    for key, step in final.items():
        print(f"bucket {key}: {step}")
        assert (sizing.in_use_bytes + sizing.kv_bytes + step.temp_bytes
                + STEPS_IN_FLIGHT * step.io_bytes) <= sizing.budget_bytes
    # The flat 10% margin would have left memory unused (measured, not assumed): its
    # reserve is larger than this step's needs.
    assert _report(sizing, memory, "XLA:CPU, 2 layers") > 0


@pytest.mark.gpu_compile
def test_llama3_8b_sizing_from_an_h100_compile(monkeypatch):
    """The same sizing with the temporaries of the step compiled for an H100: the step the
    runner would launch there (the "pallas" kernel, bf16 cache), built as
    tests/kernels/test_model_step.py does, since the runner places its arrays on real
    devices."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from jaxllm.kernels import gpu_compile as gc
    from jaxllm.kernels import tuning
    from jaxllm.models.parallel import ParallelOps
    from jaxllm.runner.step import abstract_inputs, make_step_fn

    # The tiles the kernel picks on an H100 (it asks the default device otherwise).
    monkeypatch.setattr(tuning, "detect_target", lambda: "h100")
    config = EngineConfig(max_model_len=8192).resolved(8192, on_accelerator=True)
    cfg = _llama3_8b(LAYERS)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=jnp.bfloat16,
                                                    rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    layer_bytes = _nbytes(nnx.state(model.model.layers[0]))
    T, S, W = config.max_num_batched_tokens, config.max_num_seqs, 8192 // 16
    history = jax.ShapeDtypeStruct((config.max_num_seqs, 8192), jnp.int32)
    in_use = _nbytes(state) + (32 - LAYERS) * layer_bytes + _nbytes(history)
    memory = DeviceMemory(bytes_limit=H100_BYTES_LIMIT, bytes_in_use=in_use)
    per_block = kv_bytes_per_block(_llama3_8b(), 16, jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((provisional_num_blocks(config, memory, per_block), 16,
                                  cfg.num_key_value_heads, cfg.head_dim), jnp.bfloat16)
    caches = [(cache, cache)] * LAYERS
    result = gc.compile_for_target(
        make_step_fn(graphdef, ParallelOps.single_device("pallas")),
        (state, caches, history, *abstract_inputs(T, S, W, vocab_size=cfg.vocab_size)), "h100")
    step = StepMemory.of(result.memory, _nbytes((state, caches, history)))
    sizing = size_from_profile(config, memory, per_block, {(T, W): step})
    print(f"\nH100 step at T={T}: {step}")
    assert 0 < step.io_bytes < 16 << 20
    assert sizing.in_use_bytes + sizing.kv_bytes + sizing.reserved_bytes <= sizing.budget_bytes
    assert _report(sizing, memory, "H100 target, 2 layers") > 0
