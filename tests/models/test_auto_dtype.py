"""dtype="auto" on a CPU by measurement (models/auto_dtype.py, models/dtype.py): the rule, the
verdict cache and its key, an explicit dtype winning, and the engine running what was
measured, agreed across processes."""

import json
import logging
import types

import jax.numpy as jnp
import numpy as np
import pytest

from engine_e2e.tiny_model import build_tiny_llama_dir
from jaxllm.models import auto_dtype
from jaxllm.models.auto_dtype import (AutoDtypeVerdict, GemmShapes, auto_dtype_verdict,
                                      choose, linear_methods_for, time_gemms)
from jaxllm.models.dtype import cpu_flags, cpu_model, resolve_dtype

SHAPES = GemmShapes(rows=4, hidden=16, intermediate=32, q_width=16, kv_width=8)


class FakeTimer:
    """time_gemms stand-in: returns the given (bf16 ms, f32 ms) and counts its calls."""

    def __init__(self, bf16_ms, f32_ms):
        self.result, self.calls = (bf16_ms, f32_ms), 0

    def __call__(self, shapes, methods):
        assert set(methods) == {"bfloat16", "float32"}
        self.calls += 1
        return self.result


@pytest.mark.parametrize("bf16_ms, f32_ms, expected", [
    (1.00, 2.00, "bfloat16"),
    (1.00, 1.04, "bfloat16"),  # 4% faster: past the 3% margin
    (1.00, 1.02, "float32"),  # 2% faster: a near tie goes to the exact dtype
    (1.00, 1.00, "float32"),
    (1.35, 1.00, "float32"),  # the Intel Xeon: bf16 0.74x f32
])
def test_bf16_is_chosen_only_past_the_margin(bf16_ms, f32_ms, expected):
    assert choose(bf16_ms, f32_ms) == expected


@pytest.mark.parametrize("linear_backend", ["xla", None])
def test_time_gemms_runs_the_model_linears_in_both_dtypes(linear_backend):
    bf16_ms, f32_ms = time_gemms(SHAPES, linear_methods_for(linear_backend))
    assert bf16_ms > 0 and f32_ms > 0


def test_the_engines_linear_methods_are_timed():
    assert {d: m.name for d, m in linear_methods_for("xla").items()} == {
        "bfloat16": "xla", "float32": "xla"}
    assert {d: m.name for d, m in linear_methods_for(None, tensor_parallel_size=2).items()} == {
        "bfloat16": "xla", "float32": "xla"}


def test_projections_are_one_llama_layers():
    assert GemmShapes(64, 576, 1536, 576, 192).projections() == [
        (576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]


def test_verdict_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    path = str(tmp_path / "auto_dtype.json")
    timer = FakeTimer(1.0, 2.0)
    monkeypatch.setattr(auto_dtype, "time_gemms", timer)
    first = auto_dtype_verdict(SHAPES, path)
    assert (first.dtype, first.bf16_ms, first.f32_ms, first.source) == (
        "bfloat16", 1.0, 2.0, "measured")
    second = auto_dtype_verdict(SHAPES, path)
    assert (second.dtype, second.bf16_ms, second.f32_ms, second.source) == (
        "bfloat16", 1.0, 2.0, f"cached in {path}")
    assert timer.calls == 1
    with open(path) as f:
        [(key, entry)] = json.load(f).items()
    assert key == auto_dtype.machine_key(SHAPES, linear_methods_for())
    assert cpu_model() in key and SHAPES.key() in key
    assert (entry["dtype"], entry["bf16_ms"], entry["f32_ms"]) == ("bfloat16", 1.0, 2.0)


def test_other_shapes_or_xla_flags_are_measured_again(tmp_path, monkeypatch):
    path = str(tmp_path / "auto_dtype.json")
    timer = FakeTimer(2.0, 1.0)
    monkeypatch.setattr(auto_dtype, "time_gemms", timer)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    auto_dtype_verdict(SHAPES, path)
    auto_dtype_verdict(GemmShapes(8, 16, 32, 16, 8), path)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    auto_dtype_verdict(SHAPES, path)
    assert timer.calls == 3
    with open(path) as f:
        assert len(json.load(f)) == 3


def test_no_cache_path_measures_every_time(monkeypatch):
    timer = FakeTimer(2.0, 1.0)
    monkeypatch.setattr(auto_dtype, "time_gemms", timer)
    assert [auto_dtype_verdict(SHAPES, None).dtype for _ in range(2)] == ["float32"] * 2
    assert timer.calls == 2


@pytest.mark.parametrize("damage", ["not json", "[1, 2]", '{"KEY": {"dtype": "float16"}}',
                                    '{"KEY": {"dtype": "bfloat16", "bf16_ms": "x"}}'])
def test_a_damaged_cache_is_measured_again_and_rewritten(tmp_path, monkeypatch, damage):
    path = tmp_path / "auto_dtype.json"
    path.write_text(damage.replace("KEY", auto_dtype.machine_key(SHAPES, linear_methods_for())))
    timer = FakeTimer(1.0, 3.0)
    monkeypatch.setattr(auto_dtype, "time_gemms", timer)
    assert auto_dtype_verdict(SHAPES, str(path)).source == "measured"
    assert auto_dtype_verdict(SHAPES, str(path)).source == f"cached in {path}"
    assert timer.calls == 1


def test_describe_gives_both_figures_and_the_choice():
    verdict = AutoDtypeVerdict("float32", 1.35, 1.0, SHAPES, "measured")
    assert verdict.describe() == (
        'dtype="auto" on this CPU is float32: one layer\'s decode GEMMs (rows=4 hidden=16 '
        "intermediate=32 q=16 kv=8) take 1.35 ms in bfloat16 and 1.00 ms in float32 (bf16 "
        "0.74x f32; bf16 is chosen above 1.03x) [measured]")


def refuse(*args):
    raise AssertionError("an explicit dtype or an accelerator must not measure")


@pytest.mark.parametrize("name, expected", [("float32", jnp.float32), ("bfloat16", jnp.bfloat16),
                                            ("float16", jnp.float16)])
def test_an_explicit_dtype_always_wins(name, expected):
    assert resolve_dtype(name, "cpu", refuse) == expected


def test_auto_on_an_accelerator_is_bfloat16_unmeasured():
    assert resolve_dtype("auto", "gpu", refuse) == jnp.bfloat16


@pytest.mark.parametrize("measured, expected", [("bfloat16", jnp.bfloat16),
                                                ("float32", jnp.float32)])
def test_auto_on_a_cpu_is_what_was_measured(measured, expected):
    verdict = AutoDtypeVerdict(measured, 1.0, 1.0, SHAPES, "measured")
    assert resolve_dtype("auto", "cpu", lambda: verdict) == expected


def test_cpuinfo_fields(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ "
                    "2.70GHz\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n")
    assert cpu_model(str(path)) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert cpu_flags(str(path)) == frozenset({"fpu", "avx512f", "avx512_bf16", "amx_tile"})
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


# ---- the engine: what it runs is what was measured, logged once, agreed across processes

@pytest.fixture
def tiny_dir(tmp_path):
    return build_tiny_llama_dir(str(tmp_path / "tiny"))


@pytest.mark.parametrize("timed, expected", [((1.0, 2.0), "bfloat16"), ((2.0, 1.0), "float32")])
def test_the_engine_runs_the_measured_dtype_and_logs_it_once(tiny_dir, monkeypatch, caplog,
                                                             timed, expected):
    from jaxllm import LLM

    monkeypatch.setattr(auto_dtype, "time_gemms", FakeTimer(*timed))
    monkeypatch.setattr(auto_dtype, "_logged", set())
    with caplog.at_level(logging.INFO, logger="jaxllm.models.auto_dtype"):
        for _ in range(2):
            llm = LLM(model=tiny_dir, dtype="auto", max_num_seqs=2, max_num_batched_tokens=16,
                      max_model_len=64, enforce_eager=True, use_tqdm_on_load=False,
                      compilation_cache_dir=None)
            assert np.dtype(llm.llm_engine.runner.kv_dtype).name == expected
    logged = [r.getMessage() for r in caplog.records if r.name == "jaxllm.models.auto_dtype"]
    assert len(logged) == 1 and logged[0].startswith(f'dtype="auto" on this CPU is {expected}')


@pytest.mark.parametrize("others_vote, expected", [(1, "bfloat16"), (0, "float32")])
def test_every_process_runs_bf16_only_if_all_measured_it_faster(monkeypatch, others_vote,
                                                                 expected):
    """LLMEngine._resolve_dtype with a process group whose other member votes `others_vote`
    (1: bf16 faster there too)."""
    from jaxllm.config import EngineConfig
    from jaxllm.llm_engine import LLMEngine
    votes = []

    class Group:
        def agree_min(self, name, value):
            votes.append((name, value))
            return min(value, others_vote)

    mcfg = types.SimpleNamespace(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                 head_dim=8, num_key_value_heads=1)
    monkeypatch.setattr("jaxllm.llm_engine.read_checkpoint_config",
                        lambda resolved, use_cache: (mcfg, None))
    monkeypatch.setattr(auto_dtype, "time_gemms", FakeTimer(1.0, 2.0))
    engine = types.SimpleNamespace(process_group=Group())
    dtype, reader = LLMEngine._resolve_dtype(engine, EngineConfig(dtype="auto"), None,
                                             use_cache=False)
    assert votes == [("auto_dtype_bf16", 1)]
    assert (np.dtype(dtype).name, reader) == (expected, None)


def fake_methods(**names):
    return lambda linear_backend=None, tensor_parallel_size=1: {
        dtype: types.SimpleNamespace(name=name) for dtype, name in names.items()}


def test_other_linear_methods_are_measured_again(tmp_path, monkeypatch):
    path = str(tmp_path / "auto_dtype.json")
    timer = FakeTimer(1.0, 2.0)
    monkeypatch.setattr(auto_dtype, "time_gemms", timer)
    monkeypatch.setattr(auto_dtype, "linear_methods_for", fake_methods(bfloat16="cpu",
                                                                       float32="cpu"))
    auto_dtype_verdict(SHAPES, path)
    auto_dtype_verdict(SHAPES, path)
    monkeypatch.setattr(auto_dtype, "linear_methods_for", fake_methods(bfloat16="xla",
                                                                       float32="cpu"))
    auto_dtype_verdict(SHAPES, path)
    assert timer.calls == 2
    with open(path) as f:
        keys = sorted(json.load(f))
    assert [k.split(" | ")[3] for k in keys] == ["linear bfloat16=cpu float32=cpu",
                                                 "linear bfloat16=xla float32=cpu"]


def test_a_linear_backend_that_cannot_run_bf16_makes_auto_float32_unmeasured(monkeypatch):
    monkeypatch.setattr(auto_dtype, "time_gemms", refuse)
    monkeypatch.setattr(auto_dtype, "linear_methods_for", fake_methods(float32="cpu"))
    verdict = auto_dtype_verdict(SHAPES, None, linear_backend="cpu")
    assert verdict.dtype == "float32"
    assert verdict.describe() == ('dtype="auto" on this CPU is float32 [linear_backend="cpu" '
                                  "cannot run bfloat16 here]")
