"""The C++ GEMM (kernels/cpu_gemm.py, csrc/cpu_gemm.cc) and the "cpu" linear method.

The oracle is float64 on the very inputs the kernel gets (bf16 or f32 values): the exact
sum S = sum_k x[m, k] W[k, n]. The kernel's products of two bf16 are exact in f32, and it adds
K of them in f32, so its f32 result may differ from S by at most K * 2^-24 * sum_k |x W| (the
classic bound for K roundings); for f32 inputs the products round too, one more 2^-24 each.
A bf16 result must be exactly the f32 one rounded to nearest even (values are drawn away from
bf16's subnormals, which vcvtneps2bf16 flushes to zero).

Shapes cross every edge of the kernel: rows against its 12-row micro-tiles and its 72-row
chunks (8-row tiles and 48-row chunks for bf16 with K > 1024), columns against the 32-column
panels (partial last panel, N < 32), odd K (the packing's zero pair), K = 1, sizes below and
above the single-thread cut-off, and a subprocess with 3
pool threads (other work splits, the same bits).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm import LLM, SamplingParams
from jaxllm.kernels import cpu_gemm, linear_methods
from jaxllm.kernels.linear_methods import get_linear_method, select_linear_method
from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.parallel import ParallelOps
from engine_e2e.tiny_model import build_tiny_llama_dir
from platform_choice import ON_GPU

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="setup.py builds the cpu GEMM library on Linux only"),
    pytest.mark.skipif(ON_GPU, reason="the C++ GEMM runs on the CPU platform"),
    pytest.mark.skipif(not cpu_gemm.availability(jnp.bfloat16),
                       reason=f"{cpu_gemm.availability(jnp.bfloat16).reason}"),
]

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def inputs(M, K, N, dtype, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.1, dtype)
    return x, w


def run(x, packed, n):
    f = jax.jit(lambda x, p: (cpu_gemm.gemm(x, p, n, jnp.float32),
                              cpu_gemm.gemm(x, p, n, jnp.bfloat16)))
    return f(x, packed)


def check(x, w):
    """The kernel on (x, pack(w)) against the float64 oracle; both output dtypes."""
    K, N = w.shape
    y32, y16 = run(x, cpu_gemm.pack(w), N)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    exact, magnitude = x64 @ w64, np.abs(x64) @ np.abs(w64)
    # K roundings of the running sum (and, for f32 inputs, one per product); 1 + 1e-4 covers
    # the second-order term of the bound (K u / (1 - K u)).
    roundings = K + (1 if x.dtype == jnp.float32 else 0)
    bound = roundings * 2.0 ** -24 * (1 + 1e-4) * magnitude
    err = np.abs(np.asarray(y32, np.float64) - exact)
    assert np.all(err <= bound), f"max err / bound {np.max(err / np.maximum(bound, 1e-300))}"
    np.testing.assert_array_equal(np.asarray(y16.astype(jnp.float32)),
                                  np.asarray(y32.astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.parametrize("dtype", list(DTYPES))
@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 90), K=st.integers(1, 300), N=st.integers(1, 100),
       seed=st.integers(0, 2 ** 16))
def test_matches_float64(dtype, M, K, N, seed):
    check(*inputs(M, K, N, DTYPES[dtype], seed))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("M,K,N", [
    (1, 1, 1),            # everything a tail
    (12, 64, 32),         # one full micro-tile, one full panel
    (13, 64, 33),         # one row and one column past them
    (72, 96, 64),         # one whole chunk of 6 micro-tiles
    (73, 96, 65),         # a second chunk of one row
    (64, 577, 200),       # odd K: the last k pairs with the packing's zero row
    (2, 576, 576),        # decode at SmolLM2's q/o shape: the pool splits the panels
    (200, 1536, 96),      # prefill-sized rows against few panels
    (73, 1536, 40),       # bf16 K > 1024: 8-row micro-blocks, 6 of them per 48-row chunk
    (5, 1025, 33),        # the first such K (odd), fewer rows than one block
])
def test_edges(dtype, M, K, N):
    check(*inputs(M, K, N, DTYPES[dtype], seed=M * 1000 + K + N))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("K,N", [(576, 200), (1537, 70)])
def test_a_row_gets_the_same_bits_whatever_m_and_the_other_rows(dtype, K, N):
    # Speculative decoding's greedy equality rests on it: a row verified among M = 5 or 8
    # rows of a draft, or among 512 of a prefill chunk, must come out as it does alone, so
    # its sum over K may depend neither on M, nor on the micro-tile, the work item or the
    # thread that computes it. K = 1537: odd, and past 1024 (8-row micro-blocks).
    x_1K, w = inputs(1, K, N, DTYPES[dtype], seed=K)
    packed = cpu_gemm.pack(w)
    alone = [np.asarray(y) for y in run(x_1K, packed, N)]
    rng = np.random.default_rng(N)
    for M in (1, 5, 8, 64, 512):
        others = jnp.asarray(rng.standard_normal((M, K)), DTYPES[dtype])
        for at in sorted({0, M // 2, M - 1}):
            ys = run(others.at[at].set(x_1K[0]), packed, N)
            for y, want in zip(ys, alone):
                np.testing.assert_array_equal(np.asarray(y)[at].view(np.uint8),
                                              want[0].view(np.uint8), err_msg=f"M={M} at={at}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("K,N", [(5, 70), (64, 32), (3, 1)])
def test_pack_round_trips_and_pads_with_zeros(dtype, K, N):
    w = inputs(1, K, N, DTYPES[dtype], seed=K + N)[1]
    packed = cpu_gemm.pack(w)
    assert packed.shape == cpu_gemm.packed_shape(K, N, w.dtype)
    np.testing.assert_array_equal(np.asarray(cpu_gemm.unpack(packed, K, N)), np.asarray(w))
    full = np.asarray(cpu_gemm.unpack(packed, packed.size // (packed.shape[0] * 32),
                                      packed.shape[0] * 32))
    assert not full[K:].any() and not full[:, N:].any()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_columns_are_the_rows_of_a_packed_embedding(dtype):
    table = inputs(1, 100, 9, DTYPES[dtype], seed=3)[1]  # [V = 100, D = 9]
    packed = cpu_gemm.pack(table.T)
    ids = jnp.array([0, 31, 32, 99, 5, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(cpu_gemm.columns(packed, ids, 9)),
                                  np.asarray(table)[np.asarray(ids)])


def test_a_nan_row_stays_in_its_row():
    x, w = inputs(20, 64, 40, jnp.bfloat16, seed=4)
    x = x.at[7, 3].set(jnp.nan)
    y32, _ = run(x, cpu_gemm.pack(w), 40)
    y32 = np.asarray(y32)
    assert np.isnan(y32[7]).all() and not np.isnan(np.delete(y32, 7, axis=0)).any()


def test_bad_arguments_are_value_errors():
    x, w = inputs(4, 64, 40, jnp.bfloat16, seed=5)
    packed = cpu_gemm.pack(w)
    with pytest.raises(ValueError, match="does not fit K = 64, N = 70"):
        cpu_gemm.gemm(x, packed, 70)
    with pytest.raises(ValueError, match="x is float32 but the packed weight is bfloat16"):
        cpu_gemm.gemm(x.astype(jnp.float32), packed, 40)
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
        cpu_gemm.gemm(x, packed, 40, jnp.float16)


def test_reference_has_the_same_contract():
    x, w = inputs(9, 70, 50, jnp.float32, seed=6)
    packed = cpu_gemm.pack(w)
    np.testing.assert_allclose(np.asarray(cpu_gemm.gemm_reference(x, packed, 50)),
                               np.asarray(cpu_gemm.gemm(x, packed, 50)), rtol=2e-5, atol=2e-5)


def test_concurrent_callers_get_their_own_results():
    # A second caller finds the pool busy and runs its items on its own thread.
    cases = [inputs(64, 576, 576, jnp.bfloat16, seed) for seed in range(4)]
    packed = [cpu_gemm.pack(w) for _, w in cases]
    expected = [np.asarray(run(x, p, 576)[0]) for (x, _), p in zip(cases, packed)]
    bad, errors = [], []

    def worker(i):
        try:
            for _ in range(10):
                if not np.array_equal(np.asarray(run(cases[i][0], packed[i], 576)[0]),
                                      expected[i]):
                    bad.append(i)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not bad


def test_three_threads_give_the_same_bits():
    code = (
        "import numpy as np, jax, jax.numpy as jnp\n"
        "from jaxllm.kernels import cpu_gemm\n"
        "assert cpu_gemm.num_threads() == 3, cpu_gemm.num_threads()\n"
        "rng = np.random.default_rng(0)\n"
        "for M, K, N in [(2, 576, 576), (100, 300, 1000)]:\n"
        "    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)\n"
        "    w = jnp.asarray(rng.standard_normal((K, N)), jnp.bfloat16)\n"
        "    y = cpu_gemm.gemm(x, cpu_gemm.pack(w), N)\n"
        "    np.save(f'{M}.npy', np.asarray(y))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = {}
    for threads in ("1", "3"):
        cwd = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"jaxllm-gemm-{os.getpid()}-{threads}")
        os.makedirs(cwd, exist_ok=True)
        env = dict(os.environ, JAXLLM_CPU_GEMM_THREADS=threads, JAX_PLATFORMS="cpu",
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", code.replace("== 3", f"== {threads}")],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[threads] = [np.load(os.path.join(cwd, f"{M}.npy")) for M in (2, 100)]
    for a, b in zip(outs["1"], outs["3"]):
        np.testing.assert_array_equal(a, b)


# ---- the "cpu" linear method, in the model -------------------------------------------------

def tiny_model(dtype, *, tie: bool, bias: bool):
    cfg = ModelConfig.from_hf_config(dict(
        architectures=["Qwen2ForCausalLM" if bias else "LlamaForCausalLM"], vocab_size=300,
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=tie))
    model = LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    if bias:  # nnx initialises biases to zero: give them values that show
        for _, m in nnx.iter_modules(model):
            if isinstance(m, nnx.Linear) and m.bias is not None:
                m.bias = nnx.Param(jnp.full(m.bias.shape, 0.25, m.bias.dtype))
    return model


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)], ids=["tied", "untied-bias"])
def test_method_matches_xla_in_every_layer(dtype, tie, bias):
    """Each op the forward runs (linear, embed, logits), "cpu" against "xla" on one model."""
    xla_model = tiny_model(DTYPES[dtype], tie=tie, bias=bias)
    cpu_model = tiny_model(DTYPES[dtype], tie=tie, bias=bias)
    cpu_model.process_weights_after_loading(get_linear_method("cpu"))
    xla_ops = ParallelOps.single_device("xla", "xla")
    cpu_ops = ParallelOps.single_device("xla", "cpu")
    ids = jnp.array([0, 5, 299, 31, 32], jnp.int32)
    def emb(model, ops):
        return ops.embed(model.model.embed_tokens.embedding[...], ids, features=64)

    np.testing.assert_array_equal(np.asarray(emb(cpu_model, cpu_ops)),
                                  np.asarray(emb(xla_model, xla_ops)))
    x = emb(xla_model, xla_ops)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        got = cpu_ops.linear(getattr(cpu_model.model.layers[0].self_attn, name), x)
        want = xla_ops.linear(getattr(xla_model.model.layers[0].self_attn, name), x)
        assert got.dtype == want.dtype == DTYPES[dtype]
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   **tol)
    got = cpu_model.compute_logits(x, cpu_ops)
    want = xla_model.compute_logits(x, xla_ops)
    assert got.shape == want.shape == (5, 300) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)


TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_gemm")), **TINY)


def test_greedy_run_matches_xla(tiny_dir):
    # float32: the methods' sums differ only in order, far below the logit gaps of greedy.
    prompts = [[100 + i for i in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for method in ("xla", "cpu"):
        llm = LLM(tiny_dir, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                  enforce_eager=True, use_tqdm_on_load=False, linear_backend=method,
                  dtype="float32")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[method] = [o.outputs[0].token_ids for o in outs]
    assert runs["cpu"] == runs["xla"]


# ---- choosing the method -------------------------------------------------------------------

@pytest.fixture
def fresh_choice():
    for fn in (cpu_gemm.availability, cpu_gemm._library, linear_methods._warn_fallback,
               linear_methods._log_choice):
        fn.cache_clear()
    yield
    for fn in (cpu_gemm.availability, cpu_gemm._library, linear_methods._warn_fallback,
               linear_methods._log_choice):
        fn.cache_clear()


def test_default_is_cpu_here_and_logged_once(fresh_choice, caplog):
    with caplog.at_level("INFO", logger="jaxllm.kernels.linear_methods"):
        for _ in range(2):
            assert select_linear_method(None, jnp.bfloat16, platform="cpu").name == "cpu"
    assert [r.getMessage() for r in caplog.records] == [
        'linear layers: "cpu" (the C++ GEMM (kernels/cpu_gemm.py) on weights packed at load, '
        "and its grouped GEMM on expert weights in place) for bfloat16 weights, the default "
        "here"]


def test_tensor_parallelism_and_gpus_use_xla_without_a_warning(fresh_choice):
    assert select_linear_method(None, jnp.bfloat16, tensor_parallel_size=2,
                                platform="cpu").name == "xla"
    assert select_linear_method(None, jnp.bfloat16, platform="gpu").name == "xla"
    with pytest.raises(ValueError, match="cannot see into an FFI call"):
        select_linear_method("cpu", jnp.bfloat16, tensor_parallel_size=2, platform="cpu")


def test_a_cpu_without_avx512_bf16_falls_back_and_says_why_once(fresh_choice, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    with pytest.warns(RuntimeWarning, match=r'"cpu" is unavailable for bfloat16 weights \(this '
                                            r'CPU has no AVX512-BF16\); using "xla" instead, '
                                            r"which is slower: XLA's bf16 GEMMs") as record:
        for _ in range(2):
            assert select_linear_method(None, jnp.bfloat16, platform="cpu").name == "xla"
    assert len(record) == 1
    # float32 needs only AVX-512F.
    assert select_linear_method(None, jnp.float32, platform="cpu").name == "cpu"
    with pytest.raises(ValueError, match='linear_backend="cpu" cannot run bfloat16 weights on '
                                         'platform "cpu": this CPU has no AVX512-BF16'):
        select_linear_method("cpu", jnp.bfloat16, platform="cpu")


def test_a_missing_library_falls_back_and_says_why(fresh_choice, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "library_path", lambda: None)
    with pytest.warns(RuntimeWarning, match=r"the library _cpu_gemm\*.so is not built"):
        assert select_linear_method(None, jnp.float32, platform="cpu").name == "xla"


def test_ops_refuse_cpu_under_a_mesh():
    from jaxllm.kernels.backends import AttentionLayer, get_backend
    mesh = types.SimpleNamespace(size=2)  # all ParallelOps asks of a mesh here
    with pytest.raises(ValueError, match='linear method "cpu" cannot run under tensor '
                                         "parallelism"):
        ParallelOps(AttentionLayer(get_backend("xla"), mesh), get_linear_method("cpu"))
