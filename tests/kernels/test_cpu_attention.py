"""Backend "cpu" (kernels/cpu_attention.py, the C++ FFI kernel of kernels/csrc) against the
float64 oracle on hypothesis-drawn ragged batches: decode-only, prefill-only and mixed, q_len
0 / 1 / many, contexts on page and 16-key block boundaries, empty and padding sequences, GQA
groups 1..8, head dims 64 / 128 (and 80 / 40, off the fast paths), block sizes 8 / 16 / 32,
f32 / bf16 / f16 with 16-bit caches stored as uint16 bits (as the engine stores them on CPU),
NaN in every invisible slot and padding row, block tables far wider than any sequence.

The kernel's own boundaries are crossed by small batches too: 16-row query tiles (prefill
chunks of up to 40 rows), 16-key blocks, and key ranges split over the thread pool and merged
(a batch of a few long rows is split; the pool has one thread per CPU, and a subprocess runs
with 3).

The library is built by `pip install -e .` (setup.py). If it is missing these tests fail: the
backend is supported wherever setup.py builds it (Linux with a C++17 compiler).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm import LLM, SamplingParams
from jaxllm.kernels import backends, cpu_attention
from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.parallel import ParallelOps
from jaxllm.runner.step import abstract_inputs, make_step_fn
from engine_e2e.tiny_model import build_tiny_llama_dir
from oracle import (Batch, Shape, batches, check, check_long_sequence_leaves_short_ones_alone,
                    make_inputs, run)
from platform_choice import ON_GPU

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="setup.py builds the cpu backend on Linux only"),
    pytest.mark.skipif(ON_GPU, reason='the "cpu" backend runs on the CPU platform; '
                                      "JAXLLM_TEST_PLATFORM=gpu tests the GPU's")]


@functools.cache
def cpu_fn(shape: Shape, bits: bool):
    """The jitted backend; `bits`: hand it 16-bit caches as uint16 (the engine's storage)."""
    attn = backends.get_backend("cpu").attention_fn()

    def fn(q, k_cache, v_cache, *meta):
        if bits:
            k_cache, v_cache = (jax.lax.bitcast_convert_type(c, jnp.uint16)
                                for c in (k_cache, v_cache))
        return attn(q, k_cache, v_cache, *meta, sm_scale=shape.D ** -0.5, **shape.options)

    return jax.jit(fn)


def call(shape: Shape, bits: bool = False):
    fn = cpu_fn(shape, bits)
    return lambda **kw: fn(kw["q"], kw["k_cache"], kw["v_cache"], kw["block_tables"],
                           kw["seq_lens"], kw["query_start_loc"], kw["num_seqs"])


# (shape, cap on cached context or None, uint16 caches). No tuning knobs: the kernel's tiles
# are fixed, so shapes vary what it adapts to (G, H, block size, T against its 16-row tiles).
SHAPES = [
    (Shape(T=16, S=8, max_blocks=64, Hkv=2, G=4, D=64, dtype="float32"), 40, False),
    (Shape(T=40, S=4, max_blocks=6, Hkv=1, G=3, D=128, dtype="bfloat16"), None, True),
    (Shape(T=24, S=5, max_blocks=10, Hkv=2, G=1, D=64, dtype="float32", block_size=8), None,
     False),
    (Shape(T=20, S=4, max_blocks=8, Hkv=1, G=8, D=64, dtype="float16"), None, True),
    (Shape(T=40, S=5, max_blocks=4, Hkv=3, G=3, D=64, dtype="bfloat16", block_size=32), None,
     True),
    (Shape(T=24, S=4, max_blocks=40, Hkv=1, G=7, D=64, dtype="float32"), 300, False),
    (Shape(T=18, S=3, max_blocks=12, Hkv=2, G=2, D=128, dtype="bfloat16"), None, False),
    # Head dims off the fast paths: 80 (not a multiple of 32: no bf16 pairs), 40 (scalar).
    (Shape(T=12, S=3, max_blocks=6, Hkv=2, G=2, D=80, dtype="bfloat16"), None, True),
    (Shape(T=12, S=3, max_blocks=6, Hkv=1, G=3, D=40, dtype="float32"), None, False),
]
KINDS = ["decode", "prefill", "mixed"]


IDS = [f"T{s.T}-W{s.max_blocks}-P{s.block_size}-G{s.G}-D{s.D}-{s.dtype}{'-u16' if bits else ''}"
       for s, _, bits in SHAPES]


@pytest.mark.parametrize("shape,max_ctx,bits", SHAPES, ids=IDS)
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_matches_float64(shape, max_ctx, bits, data):
    kind = data.draw(st.sampled_from(KINDS))
    check(call(shape, bits), shape, data.draw(batches(shape, kind, max_ctx)))


FIXED = Shape(T=40, S=4, max_blocks=8, Hkv=2, G=4, D=64, dtype="bfloat16")


@pytest.mark.parametrize("batch", [
    Batch(q_lens=(1, 1, 1), ctx_lens=(0, 15, 47), seed=1),  # decode only, page edges
    Batch(q_lens=(17, 9), ctx_lens=(0, 0), seed=2),  # prefill only, a tile edge
    Batch(q_lens=(6, 1, 33), ctx_lens=(10, 33, 16), seed=3),  # three tiles
    Batch(q_lens=(6, 0, 1, 5), ctx_lens=(10, 20, 33, 16), seed=4),  # a sequence with no row
    Batch(q_lens=(40,), ctx_lens=(88,), seed=5),  # every row, to the last slot of the table
    Batch(q_lens=(1,), ctx_lens=(127,), seed=6),  # one row of a 256-key chunk: whole
    Batch(q_lens=(), ctx_lens=(), seed=7),  # no sequence: all padding
], ids=["decode", "prefill", "tiles", "mixed-empty-seq", "full", "one-chunk", "empty"])
@pytest.mark.parametrize("bits", [True, False], ids=["u16", "bf16"])
def test_fixed_batches(batch, bits):
    check(call(FIXED, bits), FIXED, batch)


# Rows of 3 and 4 256-key chunks: alone, each is split over the pool by whole chunks whose
# partial softmaxes are folded in order (a verify group's tile too).
LONG = Shape(T=8, S=2, max_blocks=48, Hkv=2, G=4, D=64, dtype="bfloat16")


@pytest.mark.parametrize("batch", [
    Batch(q_lens=(1,), ctx_lens=(700,), seed=8),
    Batch(q_lens=(5,), ctx_lens=(760,), seed=9),
    Batch(q_lens=(1, 1), ctx_lens=(767, 530), seed=10),
], ids=["decode", "verify", "two"])
def test_long_rows_split_over_the_pool(batch):
    check(call(LONG, True), LONG, batch)


# Sliding windows (NaN in every slot before each window) starting mid-block and mid-page,
# over contexts several windows long; long windowed decode rows are split over the pool.
WINDOWED = [
    (Shape(T=24, S=4, max_blocks=40, Hkv=1, G=3, D=64, dtype="float32", sliding_window=150,
           logits_soft_cap=3.0), None, False),
    (Shape(T=20, S=4, max_blocks=10, Hkv=2, G=2, D=64, dtype="bfloat16", block_size=8,
           sliding_window=21, logits_soft_cap=20.0), None, True),
]


@pytest.mark.parametrize("shape,max_ctx,bits", WINDOWED, ids=["w150-cap3-f32", "w21-P8-u16"])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_window_and_soft_cap_match_float64(shape, max_ctx, bits, data):
    kind = data.draw(st.sampled_from(KINDS))
    check(call(shape, bits), shape, data.draw(batches(shape, kind, max_ctx)))


def test_window_skips_pages_before_it():
    # Pages wholly before every window are never read, nor even checked: a bad block id there
    # (a page a sliding-window manager freed) is harmless. Row 1 of the split decode (600
    # keys, window 150) covers 10 key blocks, split over the pool.
    shape = WINDOWED[0][0]
    inputs = make_inputs(shape, Batch((1, 1, 9), (600, 40, 300), seed=10))
    want = run(call(shape), inputs)
    for s, page in ((0, 3), (2, 0), (2, 8)):
        inputs["block_tables"][s, page] = shape.num_blocks + 1000
    np.testing.assert_array_equal(run(call(shape), inputs), want)
    check(call(shape), shape, Batch((1, 1, 9), (600, 40, 300), seed=10))


# A thread claims its next item before running the current one and, in the current one's last
# key blocks, prefetches the next one's first. Decode rows here are shorter and longer than
# that two-block reach (contexts 0..300), one is long enough to be split over the pool, and
# with a window the next item's blocks start mid-sequence: every answer must still be its own.
RUN_ON_BF16 = Shape(T=16, S=12, max_blocks=40, Hkv=3, G=3, D=64, dtype="bfloat16",
                    block_size=8)
RUN_ON_F32 = Shape(T=16, S=12, max_blocks=20, Hkv=3, G=3, D=64, dtype="float32",
                   sliding_window=40, logits_soft_cap=5.0)


@pytest.mark.parametrize("shape,bits", [(RUN_ON_BF16, True), (RUN_ON_BF16, False),
                                        (RUN_ON_F32, False)],
                         ids=["bf16-P8-u16", "bf16-P8", "f32-w40-cap5"])
def test_items_prefetching_into_the_next_one(shape, bits):
    ctx = (0, 15, 31, 32, 47, 300, 16, 1, 100, 33, 250, 63)
    ctx = tuple(min(c, shape.max_blocks * shape.block_size - 1) for c in ctx)
    check(call(shape, bits), shape, Batch(q_lens=(1,) * 12, ctx_lens=ctx, seed=11))
    # Prefill tiles between decode rows: items of many rows next to one-row items.
    check(call(shape, bits), shape, Batch(q_lens=(1, 9, 1, 1, 3), ctx_lens=(40, 0, 5, 90, 17),
                                          seed=12))


def test_long_sequence_leaves_short_ones_alone():
    check_long_sequence_leaves_short_ones_alone(call)


def test_block_table_width_does_not_change_results():
    narrow = Shape(T=8, S=4, max_blocks=4, Hkv=2, G=2, D=64, dtype="float32")
    batch = Batch(q_lens=(1, 5, 1), ctx_lens=(47, 10, 3), seed=8)
    inputs = make_inputs(narrow, batch)
    wide = dict(inputs, block_tables=np.pad(inputs["block_tables"], ((0, 0), (0, 124))))
    wide_shape = Shape(T=8, S=4, max_blocks=128, Hkv=2, G=2, D=64, dtype="float32")
    np.testing.assert_array_equal(run(call(narrow), inputs), run(call(wide_shape), wide))


def test_concurrent_callers_get_their_own_results():
    # A second caller finds the pool busy and runs its items on its own thread.
    shape = Shape(T=16, S=4, max_blocks=32, Hkv=2, G=3, D=64, dtype="float32")
    cases = [make_inputs(shape, Batch((1, 1, 5, 1), (300, 20, 200, 450), seed))
             for seed in range(4)]
    fn = call(shape)
    expected = [run(fn, c) for c in cases]
    results, errors = {}, []

    def worker(i):
        try:
            for _ in range(20):
                out = run(fn, cases[i])
                if not np.array_equal(out, expected[i]):
                    results[i] = out
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not results


def test_three_threads_in_a_subprocess():
    # More threads than this machine may have CPUs: other split decisions, same answers.
    code = (
        "import sys, jax; sys.path.insert(0, 'tests/kernels')\n"
        "from jaxllm.kernels import cpu_attention as ca\n"
        "from oracle import Batch, Shape, check\n"
        "assert ca.num_threads() == 3, ca.num_threads()\n"
        "shape = Shape(T=40, S=4, max_blocks=8, Hkv=2, G=4, D=64, dtype='float32')\n"
        "fn = jax.jit(lambda q, k, v, *m: ca.ragged_paged_attention(q, k, v, *m,\n"
        "                                                         sm_scale=0.125))\n"
        "call = lambda **kw: fn(*kw.values())\n"
        "for b in [Batch((1,), (127,), 1), Batch((1, 1, 33), (60, 90, 20), 2)]:\n"
        "    check(call, shape, b)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAXLLM_CPU_ATTENTION_THREADS="3", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_bad_block_ids_raise_instead_of_reading_wild_memory():
    shape = Shape(T=8, S=2, max_blocks=4, Hkv=1, G=2, D=64, dtype="float32")
    inputs = make_inputs(shape, Batch((1,), (20,), seed=9))
    inputs["block_tables"][0, 1] = shape.num_blocks + 1000
    with pytest.raises(Exception, match="outside the cache"):
        run(call(shape), inputs)


def test_dtype_mismatch_is_a_value_error():
    attn = backends.get_backend("cpu").attention_fn()
    q = jnp.zeros((4, 2, 64), jnp.float32)
    cache = jnp.zeros((3, 16, 1, 64), jnp.uint16)
    meta = (jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32),
            jnp.int32(0))
    with pytest.raises(ValueError, match="float32 q with a float32 cache"):
        attn(q, cache, cache, *meta, sm_scale=0.125)


# ---- inside the engine ---------------------------------------------------------------------

TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_cpu")), **TINY)


# bfloat16: what dtype="auto" picks where bf16 measures faster, and the uint16 cache path
# (float32 is the same engine code with an f32 cache; the kernel's f32 numerics are tested
# above).
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_greedy_run_matches_xla(tiny_dir, dtype):
    prompts = [[100 + i for i in range(n)] for n in (3, 17, 40)]  # cross 16-token blocks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for backend in ("xla", "cpu"):
        llm = LLM(tiny_dir, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                  enforce_eager=True, use_tqdm_on_load=False, attention_backend=backend,
                  dtype=dtype)
        if backend == "cpu":
            cache_dtype = llm.llm_engine.runner.kv_caches[0][0].dtype
            assert cache_dtype == jnp.uint16  # bf16 bits: XLA:CPU has no bf16 scatter
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[backend] = [o.outputs[0].token_ids for o in outs]
    # The 40-token prompt is chunked over two steps (budget 32): a chunk over a cached prefix.
    assert runs["cpu"] == runs["xla"]


def test_whole_step_calls_the_kernel():
    cfg = ModelConfig.from_hf_config(dict(architectures=["LlamaForCausalLM"], vocab_size=512,
                                          intermediate_size=256, num_hidden_layers=2,
                                          max_position_embeddings=1024, **TINY))
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cache = jax.ShapeDtypeStruct((64, 16, 2, 64), jnp.uint16)
    token_history = jax.ShapeDtypeStruct((8, 256), jnp.int32)
    step = make_step_fn(graphdef, ParallelOps.single_device("cpu"))
    text = step.lower(state, [(cache, cache)] * 2, token_history,
                      *abstract_inputs(16, 4, 16)).as_text()
    assert text.count(cpu_attention.TARGET) == cfg.num_hidden_layers


# ---- without the library -----------------------------------------------------------------

@pytest.fixture
def no_library(monkeypatch):
    monkeypatch.setattr(cpu_attention, "library_path", lambda: None)
    cpu_attention.availability.cache_clear()
    backends._warn_fallback.cache_clear()
    yield
    cpu_attention.availability.cache_clear()
    backends._warn_fallback.cache_clear()


def test_library_is_built_and_loads():
    status = cpu_attention.availability()
    assert status, status.reason
    assert cpu_attention.num_threads() >= 1


def test_missing_library_falls_back_to_xla_and_says_so_once(no_library):
    assert not cpu_attention.availability()
    assert "not built" in cpu_attention.availability().reason
    with pytest.warns(RuntimeWarning, match=r'"cpu" is unavailable \(the library .*not '
                                            r'built.*\); using "xla" instead, which is slower: '
                                            r'attention in "xla" took 2.2x-10x') as record:
        assert backends.select_backend(None, "cpu").name == "xla"
        assert backends.select_backend(None, "cpu").name == "xla"
    assert len(record) == 1
    with pytest.raises(ValueError, match='attention_backend="cpu" cannot run on platform '
                                         '"cpu": the library .*not built'):
        backends.select_backend("cpu", "cpu")


def test_broken_library_falls_back_to_xla(no_library, monkeypatch, tmp_path):
    broken = tmp_path / "_cpu_attention.so"
    broken.write_bytes(b"not a shared object")
    monkeypatch.setattr(cpu_attention, "library_path", lambda: str(broken))
    assert "failed to load" in cpu_attention.availability().reason
    with pytest.warns(RuntimeWarning, match="failed to load"):
        assert backends.select_backend(None, "cpu").name == "xla"


def test_llm_warns_when_the_library_is_missing(no_library, tiny_dir):
    with pytest.warns(RuntimeWarning, match='"cpu" is unavailable'):
        llm = LLM(tiny_dir, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
                  enforce_eager=True, use_tqdm_on_load=False)
    assert llm.llm_engine.runner.attention_backend.name == "xla"


def test_default_backend_is_cpu_with_or_without_tensor_parallelism():
    # Tensor parallelism runs every backend per shard (kernels/backends.py), "cpu" included.
    assert backends.select_backend(None, "cpu").name == "cpu"
