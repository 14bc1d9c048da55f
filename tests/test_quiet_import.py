"""`import jaxllm` prints nothing a user cannot act on, with or without torch and a GPU.

The subprocess tests start a fresh interpreter with no platform chosen (JAX_PLATFORMS unset,
unlike the rest of the suite) and torch blocked, as in an install without the `test` extra.
The only stderr lines allowed are the CUDA plugin's C++ start-up notes (see ALLOWED), which
its extension modules print when they load and no CUDA runtime library is installed; nothing
in Python can turn them off.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from jaxllm import platform

ALLOWED = [
    re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are "
               r"written to STDERR"),
    re.compile(r"I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on "
               r"your machine, GPU will not be used\."),
]
HAS_NVIDIA_GPU = any(os.path.exists(f) for f in platform.NVIDIA_DEVICE_FILES)

# ------------------------------------------------------------------ the decision, case by case


@pytest.mark.parametrize("environ,nvidia_gpu,plugins,libtpu,expected", [
    ({}, False, {"xla_cuda12"}, False, "cpu"),
    ({}, False, {"xla_cuda12", "xla_cuda13"}, False, "cpu"),
    ({"JAX_PLATFORMS": "cuda"}, False, {"xla_cuda12"}, False, None),  # the user chose
    ({"JAX_PLATFORMS": "cpu"}, False, {"xla_cuda12"}, False, None),  # already set
    ({"JAX_PLATFORM_NAME": "gpu"}, False, {"xla_cuda12"}, False, None),
    ({}, True, {"xla_cuda12"}, False, None),  # a GPU: the plugin will work
    ({}, False, set(), False, None),  # no plugin: jax picks the CPU quietly
    ({}, False, {"xla_cuda12", "xla_rocm7"}, False, None),  # maybe an AMD GPU
    ({}, False, {"xla_cuda12"}, True, None),  # a TPU runtime is installed
    ({"JAX_PLATFORMS": ""}, False, {"xla_cuda12"}, False, "cpu"),  # empty = unset
])
def test_platform_to_set(environ, nvidia_gpu, plugins, libtpu, expected):
    assert platform.platform_to_set(environ, nvidia_gpu=nvidia_gpu, jax_plugins=plugins,
                                    libtpu=libtpu) == expected


# ------------------------------------------------------------------ a fresh interpreter

NO_TORCH = "import sys; sys.modules['torch'] = None  # an install without torch\n"
REPORT = ("import os, jax; print(os.environ.get('JAX_PLATFORMS'), jax.config.jax_platforms, "
          "jax.devices()[0].platform, 'torch' in sys.modules and sys.modules['torch'] is not None)")


def run_fresh(code: str) -> tuple[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    noise = [line for line in run.stderr.splitlines()
             if not any(p.fullmatch(line) for p in ALLOWED)]
    return run.stdout.strip(), noise


@pytest.mark.skipif(HAS_NVIDIA_GPU, reason="on a GPU machine jax starts on the GPU")
def test_import_jaxllm_first_is_quiet_and_picks_the_cpu():
    stdout, noise = run_fresh(NO_TORCH + "import jaxllm\nfrom jaxllm import LLM\n"
                              "import jaxllm.tokenizer\n" + REPORT)
    assert noise == []  # no "PyTorch was not found", no CUDA plugin traceback
    chosen = "cpu" if platform.platform_to_set(
        {}, nvidia_gpu=False, jax_plugins=platform.installed_jax_plugins(), libtpu=False) else None
    assert stdout == f"{chosen} {chosen} cpu False"


@pytest.mark.skipif(HAS_NVIDIA_GPU, reason="on a GPU machine jax starts on the GPU")
def test_import_jax_first_still_picks_the_cpu_through_jax_config():
    stdout, noise = run_fresh(NO_TORCH + "import jax\nimport jaxllm\n" + REPORT)
    assert noise == []
    chosen = "cpu" if platform.platform_to_set(
        {}, nvidia_gpu=False, jax_plugins=platform.installed_jax_plugins(), libtpu=False) else None
    assert stdout == f"None {chosen} cpu False"


# ------------------------------------------------------------------ controls: the noise is real


def test_without_jaxllm_the_torch_shim_makes_transformers_warn():
    _, noise = run_fresh(NO_TORCH + "import transformers")
    assert [line for line in noise if "PyTorch was not found" in line] != []


@pytest.mark.skipif(HAS_NVIDIA_GPU, reason="on a GPU machine the CUDA plugin starts")
@pytest.mark.skipif(not any(p.startswith("xla_cuda") for p in platform.installed_jax_plugins()),
                    reason="needs the CUDA plugin (gpu-compile extra)")
def test_without_jaxllm_jax_prints_the_cuda_plugin_traceback():
    stdout, noise = run_fresh("import jax; print(jax.devices()[0].platform)")
    assert stdout == "cpu"
    assert "Traceback (most recent call last):" in noise
