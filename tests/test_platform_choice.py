"""JAXLLM_TEST_PLATFORM: tests/conftest.py leaves the CPU default alone, asks jax for the GPU
when told to (never falling back to the CPU), and refuses an unknown value. Each case runs in
a fresh interpreter: the platform is fixed at jax's first use."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

PROBE = """
import os, sys
sys.path.insert(0, {tests!r})
import conftest
from platform_choice import ON_GPU
print(os.environ["JAX_PLATFORMS"], os.environ.get("JAX_DEFAULT_MATMUL_PRECISION"), ON_GPU)
import jax
try:
    print(jax.default_backend())
except Exception as e:  # no GPU: the CUDA plugin failed, and jax has no backend
    print("no backend:", type(e).__name__)
"""


def _probe(platform: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAX_DEFAULT_MATMUL_PRECISION",
                        "JAXLLM_TEST_PLATFORM")}
    if platform is not None:
        env["JAXLLM_TEST_PLATFORM"] = platform
    return subprocess.run([sys.executable, "-c", PROBE.format(tests=TESTS)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_default_is_the_cpu():
    run = _probe(None)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["cpu None False", "cpu"]


def test_gpu_asks_for_cuda_and_never_falls_back():
    run = _probe("gpu")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "cuda highest True"
    if lines[1] != "gpu":  # no GPU here: jax fails rather than use the CPU
        assert lines[1].startswith("no backend:"), lines[1]
        assert "Unable to load CUDA" in run.stderr or "cuda" in run.stderr.lower()


@pytest.mark.parametrize("value", ["tpu", "GPU", ""])
def test_unknown_platform_is_refused(value):
    run = _probe(value)
    assert run.returncode != 0
    assert (f"ValueError: JAXLLM_TEST_PLATFORM must be one of ('cpu', 'gpu'), got "
            f"{value!r}") in run.stderr
