"""docs/contracts.md's import rules, checked in fresh interpreters.

Each case imports every module of one layer in a new Python process and reads `sys.modules`:
what a module pulls in transitively is what a user of that layer pays for, and a rule broken
three imports deep (runner -> config -> engine) is invisible to a grep of import lines.

  the runner (jaxllm/runner)        imports no jaxllm.engine module
  jaxllm/distributed                the same: it carries scheduler outputs to runners
  the engine (jaxllm/engine)        imports no jax, jaxlib or flax
  jaxllm.messages                   imports no layer (engine, runner, models, kernels, the
                                    front ends, entrypoints, distributed)
  jaxllm.config                     imports neither the engine nor jax (the runner reads it)
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys

import pytest

import jaxllm

PACKAGE_DIR = os.path.dirname(jaxllm.__file__)
LAYERS = ("jaxllm.engine", "jaxllm.runner", "jaxllm.models", "jaxllm.kernels",
          "jaxllm.entrypoints", "jaxllm.distributed", "jaxllm.llm", "jaxllm.llm_engine",
          "jaxllm.async_llm")


def modules_of(package: str) -> list[str]:
    path = os.path.join(PACKAGE_DIR, *package.split(".")[1:])
    return [package] + [f"{package}.{m.name}" for m in pkgutil.iter_modules([path])]


def loaded_after_importing(modules: list[str]) -> set[str]:
    """sys.modules of a fresh interpreter after importing `modules`."""
    script = ("import importlib, json, sys\n"
              f"for m in {modules!r}: importlib.import_module(m)\n"
              "print(json.dumps(sorted(sys.modules)))")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def in_layers(loaded: set[str], layers) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in layers))


def test_the_runner_imports_nothing_from_the_engine():
    loaded = loaded_after_importing(modules_of("jaxllm.runner"))
    assert "jaxllm.runner.model_runner" in loaded and "jax" in loaded  # the import happened
    assert in_layers(loaded, ["jaxllm.engine"]) == []


def test_the_distributed_executor_imports_nothing_from_the_engine():
    loaded = loaded_after_importing(modules_of("jaxllm.distributed"))
    assert "jaxllm.distributed.executor" in loaded
    assert in_layers(loaded, ["jaxllm.engine"]) == []


def test_the_engine_imports_no_jax():
    modules = modules_of("jaxllm.engine")
    assert "jaxllm.engine.scheduler" in modules and "jaxllm.engine.core" in modules
    loaded = loaded_after_importing(modules)
    assert set(modules) <= loaded
    assert in_layers(loaded, ["jax", "jaxlib", "flax"]) == []


@pytest.mark.parametrize("module", ["jaxllm.messages", "jaxllm.scheduling_policy"])
def test_neutral_modules_import_no_layer(module):
    loaded = loaded_after_importing([module])
    assert in_layers(loaded, LAYERS) == []
    assert in_layers(loaded, ["jax", "jaxlib", "flax"]) == []


def test_the_configuration_imports_neither_the_engine_nor_jax():
    # The runner reads EngineConfig; config once imported the engine for one tuple of names.
    loaded = loaded_after_importing(["jaxllm.config"])
    assert in_layers(loaded, ["jaxllm.engine", "jaxllm.runner", "jax", "jaxlib", "flax"]) == []
