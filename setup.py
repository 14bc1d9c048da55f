"""Builds the optional C++ libraries of jaxllm/kernels/csrc: the "cpu" attention backend,
the "cpu" linear method (the GEMM on weights packed at load) and the sampler's greedy top-1
(jaxllm/kernels/cpu_argmax.py; without it the sampler uses top_k).

Everything else about the package is in pyproject.toml. The extensions are optional: without
a C++ compiler or jaxlib's FFI headers jaxllm still installs, the "cpu" backend and method
report themselves unavailable (jaxllm/kernels/cpu_attention.py, cpu_gemm.py), and `LLM()`
warns once that it uses "xla" instead, with the reason and the cost
(jaxllm/kernels/backends.py, linear_methods.py).

Each library is a plain shared object loaded with ctypes (no Python module init), compiled
for the building machine's CPU (-march=native): build on the machine that runs it.
"""

from __future__ import annotations

import importlib.util
import os

from setuptools import Extension, setup

CSRC = os.path.join("jaxllm", "kernels", "csrc")


def jaxlib_include_dir() -> str | None:
    """jaxlib's bundled headers (what jax.ffi.include_dir() returns), found without importing
    jax: the build environment has jaxlib (pyproject.toml [build-system] requires)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        include = os.path.join(location, "include")
        if os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
            return include
    return None


def extensions() -> list[Extension]:
    include = jaxlib_include_dir()
    if include is None:
        print("jaxllm: jaxlib's XLA FFI headers not found; skipping the 'cpu' kernel libraries")
        return []
    # -isystem: the FFI headers' own warnings are not ours. GCC 12 reports AVX-512 intrinsics
    # as "maybe uninitialized" (their undefined pass-through operand).
    flags = ["-std=c++17", "-O3", "-march=native", "-fvisibility=hidden", "-isystem", include,
             "-Wno-maybe-uninitialized"]
    return [Extension(
        f"jaxllm.kernels._{name}",
        sources=[os.path.join(CSRC, f"{name}.cc")],
        depends=[os.path.join(CSRC, header) for header in headers],
        language="c++",
        extra_compile_args=flags,
        extra_link_args=["-pthread"],
        optional=True,
    ) for name, headers in (("cpu_attention", ("simd.h", "thread_pool.h")),
                            ("cpu_gemm", ("thread_pool.h",)),
                            ("cpu_argmax", ("thread_pool.h",)),
                            ("cpu_lora", ("simd.h", "thread_pool.h")))]


setup(ext_modules=extensions())
