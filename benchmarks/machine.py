"""What machine a benchmark ran on: the header every benchmark in benchmarks/ prints first.

Owns reading the CPU (/proc/cpuinfo's model name and the flags that decide which matrix
kernels exist), the core counts, and asking jax what it runs on and what `dtype="auto"`
resolves to. Never times anything itself and never changes jax's configuration; the "auto"
rule and its measurement are jaxllm.models.dtype's and auto_dtype's, only called here.

    cpu: AMD EPYC; 2 cores, 2 usable; avx512_bf16 yes, amx_bf16 no, amx_tile no, avx512_vnni
         yes, avx512f yes                                        (one line, wrapped here)
    jax 0.10.2, jaxlib 0.10.2; backend cpu, devices 1 x cpu; XLA_FLAGS unset
    dtype "auto" -> bfloat16 (dtype="auto" on this CPU is bfloat16: one layer's decode GEMMs
         (rows=64 ...) take 3.79 ms in bfloat16 and 6.09 ms in float32 ...)   (one line)

The header is read in a fresh interpreter with the benchmark's environment, so that the
benchmark's own process has not started a jax backend when it begins: on a GPU jax would
take most of the device's memory from the engines a benchmark starts in subprocesses, and
jaxllm may still set XLA flags before its backend starts. `python benchmarks/machine.py`
prints it alone.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

# The CPU features that decide which bf16 / int8 matrix kernels a library can use.
FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx512f")


def cpu_line(cpuinfo: str, cpu_count: int | None, usable: int | None, fallback: str) -> str:
    """The CPU line from /proc/cpuinfo's text (its first processor's "model name" and
    "flags"); `fallback` names the CPU where cpuinfo has no model name."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    marks = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in FLAGS)
    name = fields.get("model name") or fallback or "unknown CPU"
    return f"cpu: {name}; {cpu_count} cores, {usable} usable; {marks}"


def jax_line(jax_version: str, jaxlib_version: str, backend: str, device_kinds: list[str],
             xla_flags: str | None) -> str:
    kinds = ", ".join(f"{device_kinds.count(k)} x {k}" for k in dict.fromkeys(device_kinds))
    flags = f"XLA_FLAGS={xla_flags}" if xla_flags else "XLA_FLAGS unset"
    return (f"jax {jax_version}, jaxlib {jaxlib_version}; backend {backend}, "
            f"devices {kinds}; {flags}")


def dtype_line(backend: str) -> str:
    """What dtype="auto" resolves to; on a CPU with the verdict behind it (measured once per
    machine for the default model's shapes and cached where the engine caches it)."""
    import numpy as np

    from jaxllm.models.dtype import resolve_dtype

    if backend != "cpu":
        return f'dtype "auto" -> {np.dtype(resolve_dtype("auto", backend)).name}'
    from jaxllm.models.auto_dtype import auto_dtype_verdict, verdict_cache_path

    verdict = auto_dtype_verdict(cache_path=verdict_cache_path())
    dtype = np.dtype(resolve_dtype("auto", backend, measure=lambda: verdict)).name
    return f'dtype "auto" -> {dtype} ({verdict.describe()})'


def machine_header() -> str:
    """Three lines: the CPU, jax and its devices, and what dtype "auto" resolves to, as a
    fresh interpreter with this process's environment sees them."""
    run = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True,
                         text=True)
    if run.returncode != 0:
        raise RuntimeError(f"benchmarks/machine.py failed:\n{run.stderr[-3000:]}")
    return run.stdout.rstrip("\n")


def this_process_header() -> str:
    """machine_header's lines, read in this process (which starts jax's backend)."""
    import jax
    import jaxlib

    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    backend = jax.default_backend()
    return "\n".join([
        cpu_line(cpuinfo, os.cpu_count(), usable, platform.processor()),
        jax_line(jax.__version__, jaxlib.__version__, backend,
                 [d.device_kind for d in jax.devices()], os.environ.get("XLA_FLAGS")),
        dtype_line(backend)])


if __name__ == "__main__":
    print(this_process_header())
