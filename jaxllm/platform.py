"""Which JAX platform to start on when the user did not choose one.

Owns: the one start-up decision `jaxllm/__init__.py` makes before jax starts its backends. On a
machine with no NVIDIA GPU whose only accelerator plugin for jax is a CUDA one (as with the
`gpu-compile` extra, which compiles for GPUs on machines without one), run on the CPU. Left
alone, jax tries that plugin first at start-up, fails to load CUDA, and prints the failure with
a traceback before falling back to the CPU anyway.

Must never: override a platform the user chose (JAX_PLATFORMS, JAX_PLATFORM_NAME, or the
`jax_platforms` config option), choose for a machine that may have another accelerator (a TPU
runtime, a non-CUDA plugin), import jax, or start a subprocess: this runs on `import jaxllm`.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import sys
from collections.abc import Mapping, Set
from importlib.metadata import entry_points

# Present whenever the NVIDIA driver is loaded (bare metal, containers given a GPU), and
# /dev/dxg for a GPU passed through to WSL2, where the other two do not exist.
NVIDIA_DEVICE_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")


def platform_to_set(environ: Mapping[str, str], *, nvidia_gpu: bool, jax_plugins: Set[str],
                    libtpu: bool) -> str | None:
    """The platform jax should be told to use ("cpu"), or None to leave jax's own choice.

    jax_plugins: names of the installed jax PJRT plugins (e.g. {"xla_cuda12"}).
    """
    if environ.get("JAX_PLATFORMS") or environ.get("JAX_PLATFORM_NAME"):
        return None
    if nvidia_gpu or libtpu:
        return None
    if jax_plugins and all(name.startswith("xla_cuda") for name in jax_plugins):
        return "cpu"
    return None  # no plugin (jax picks the CPU quietly), or one that is not ours to judge


def installed_jax_plugins() -> set[str]:
    """The plugins jax would load: modules of the `jax_plugins` namespace and entry points."""
    names = {ep.name for ep in entry_points(group="jax_plugins")}
    spec = importlib.util.find_spec("jax_plugins")  # finds the namespace without importing it
    if spec is not None and spec.submodule_search_locations:
        names |= {m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations))}
    return names


def set_default_platform() -> str | None:
    """Apply `platform_to_set` to this machine; returns the platform set, or None."""
    platform = platform_to_set(
        os.environ, nvidia_gpu=any(os.path.exists(f) for f in NVIDIA_DEVICE_FILES),
        jax_plugins=installed_jax_plugins(), libtpu=importlib.util.find_spec("libtpu") is not None)
    if platform is None:
        return None
    jax = sys.modules.get("jax")
    if jax is None:
        os.environ["JAX_PLATFORMS"] = platform  # jax reads it when it is imported
        return platform
    # jax was imported before jaxllm: its config read the environment already.
    from jax._src import xla_bridge

    if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
        return None  # chosen through jax.config, or too late to choose
    jax.config.update("jax_platforms", platform)
    return platform
