"""The C++ kernel libraries that setup.py builds beside this package: finding and opening one.

Owns `Availability` (an opened library, or the reason there is none) and the two steps every
kernel module takes: `find(stem)`, the built file `<stem><extension suffix>` next to
kernels/, and `open_library(stem, path, handler)`, which opens it with ctypes and checks that
it exports its XLA FFI handler. Must never register FFI targets, cache, warn, or decide
whether a kernel runs: each kernel module (cpu_attention.py, cpu_gemm.py, cpu_argmax.py,
cpu_lora.py) does that with its own reason.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


class Availability:
    """Whether a kernel can run here; `reason` says why not."""

    def __init__(self, lib: ctypes.CDLL | None, reason: str):
        self.lib, self.reason = lib, reason

    def __bool__(self) -> bool:
        return self.lib is not None


def find(stem: str) -> str | None:
    """The built library next to this file (e.g. _cpu_gemm.cpython-311-x86_64-linux-gnu.so),
    or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(_HERE, stem + suffix)
        if os.path.exists(path):
            return path
    return None


def open_library(stem: str, path: str | None, handler: str) -> Availability:
    """The library at `path` (None: not built), opened, if it exports `handler`."""
    if path is None:
        return Availability(None, f"the library {stem}*.so is not built next to {_HERE} "
                                  f"(reinstall jaxllm with a C++ compiler: pip install -e .)")
    try:
        lib = ctypes.CDLL(path)
        getattr(lib, handler)  # the FFI handler must be exported
    except (OSError, AttributeError) as e:
        return Availability(None, f"{path} failed to load: {e}")
    return Availability(lib, "")
