"""Compile jitted functions for an H100, A100, L4 or H200 without a GPU, and inspect the result.

Owns: finding a target's GpuTargetConfig text proto (packaged in `jaxllm/kernels/targets/`;
the `<name>.txtpb` files of the directory named by $JAXLLM_GPU_TARGETS add or override
targets), building a CUDA device from it, compiling through XLA's real GPU pipeline (Triton
kernels included) down to PTX and cubin, and reading back what a GPU run would depend on: the
optimized HLO, the PTX, and per kernel the launch shape, shared memory, registers and spills.
`full_cache_copies` reads a GPU compile with kernels/hlo_text.py's check. Must never:
run anything on a device, read target files from anywhere but the package and
$JAXLLM_GPU_TARGETS, or be imported by the serving path (it is a test and tuning tool).

How it works (jax/jaxlib 0.10.2 + jax-cuda12-plugin, no GPU, no driver):
  * `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` gives
    a device to attach shardings to; `jit(f).trace(*specs).lower().compile()` then runs
    XLA's GPU compiler for that target. The CUDA plugin refuses to register when it cannot
    load the CUDA runtime, unless JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 is set or JAX_PLATFORMS
    excludes cuda (e.g. JAX_PLATFORMS=cpu, the usual test setting). When jax already
    initialized its backends without either, `_ensure_cuda_plugin` sets the variable and
    calls the plugin's `initialize()` again, which registers it; CPU arrays keep working.
  * Compiler option `xla_dump_to` makes XLA write the PTX of every module (`*.ptx`) and a
    `*thunk_sequence.txt` listing each launched kernel with grid, threads and shared memory
    (for Triton kernels this is Triton's own shared-memory figure).
  * Registers and spills are not in any dump: XLA runs the `ptxas` binary (PATH, then
    /usr/local/cuda/bin, ...) with `-v` but only logs its report at VLOG level. So this
    module runs the same `ptxas -v -arch=sm_XX` over the dumped PTX and parses the report.
    This jaxlib has no built-in PTX compiler (`xla_gpu_enable_libnvptxcompiler` fails with
    "LibNvPtxCompiler is not supported"), so a successful compile means a ptxas exists; if
    `find_ptxas` misses it, the stats are None and `kernel_problems` says so. The compile
    also passes `xla_gpu_fail_ptx_compilation_on_register_spilling`: XLA then rejects a
    spilling kernel itself ("Compilation result discarded due to register spilling"), and a
    Triton kernel over the shared-memory limit fails with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.resources
import math
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from jaxllm.kernels import hlo_text

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

TARGETS_ENV = "JAXLLM_GPU_TARGETS"  # a directory of extra/overriding <name>.txtpb targets
_SUFFIX = ".txtpb"


def _target_files() -> dict[str, Traversable]:
    """target name -> its text proto (a package resource, or a Path of the override dir)."""
    packaged = importlib.resources.files("jaxllm.kernels") / "targets"
    files = {f.name[:-len(_SUFFIX)]: f for f in packaged.iterdir() if f.name.endswith(_SUFFIX)}
    extra = os.environ.get(TARGETS_ENV)
    if extra:
        if not os.path.isdir(extra):
            raise ValueError(f"{TARGETS_ENV}={extra!r} is not a directory")
        files.update({p.name[:-len(_SUFFIX)]: p for p in Path(extra).glob(f"*{_SUFFIX}")})
    return files


def available_targets() -> list[str]:
    """Names `compile_for_target` accepts: the packaged targets and those of $JAXLLM_GPU_TARGETS."""
    return sorted(_target_files())


@dataclasses.dataclass(frozen=True)
class TargetInfo:
    name: str
    arch: str  # ptxas -arch value
    shared_memory_per_block_optin: int  # bytes a kernel may ask for
    registers_per_block_limit: int
    num_sms: int
    memory_bandwidth: float  # bytes / s
    description: str  # device_description_str: the device name the CUDA driver reports
    source: str  # where the text proto was read from
    config_text: str


def target_info(target: str) -> TargetInfo:
    files = _target_files()
    if target not in files:
        raise ValueError(f"unknown GPU target {target!r}; available: {', '.join(sorted(files))} "
                         f"(add one as <dir>/{target}{_SUFFIX} with {TARGETS_ENV}=<dir>)")
    return _parse_target(target, files[target].read_text(), str(files[target]))


@functools.cache
def _parse_target(target: str, text: str, source: str) -> TargetInfo:
    # `#` comments (the files' source notes) end at the line end; a `#` followed by a quote
    # may sit inside a string, so it is kept.
    body = re.sub(r"#[^\"\n]*$", "", text, flags=re.M)

    def field(name, pattern=r"([0-9.e+]+)", default=None):
        m = re.search(rf"^\s*{name}:\s*{pattern}\s*$", body, re.M)
        if m is None and default is None:
            raise ValueError(f"{source}: field {name} missing")
        return m.group(1) if m else default

    cc = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", body)
    if cc is None:
        raise ValueError(f"{source}: field cuda_compute_capability missing")
    major, minor = int(cc.group(1)), int(cc.group(2))
    arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")  # sm_90a: Hopper-specific PTX
    return TargetInfo(name=target, arch=arch,
                      shared_memory_per_block_optin=int(field("shared_memory_per_block_optin")),
                      registers_per_block_limit=int(field("registers_per_block_limit")),
                      num_sms=int(field("core_count")),
                      memory_bandwidth=float(field("memory_bandwidth")),
                      description=field("device_description_str", r'"([^"]*)"', default=""),
                      source=source, config_text=text)


def _ensure_cuda_plugin(config_text: str) -> None:
    from jax.experimental import topologies
    try:
        topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config_text)
        return
    except NotImplementedError:
        pass  # plugin skipped at backend start-up (its CUDA version check failed)
    try:
        import jax_plugins.xla_cuda12 as cuda_plugin
    except ImportError as e:
        raise RuntimeError("compiling for a GPU target needs jax-cuda12-plugin and "
                           "jax-cuda12-pjrt (pip install 'jaxllm[gpu-compile]')") from e
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    cuda_plugin.initialize()


def target_device(target: str):
    """A compile-only CUDA device described by the target's text proto."""
    return _device(target_info(target).config_text)


@functools.cache
def _device(config_text: str):
    return _devices(config_text, 1)[0]


@functools.cache
def _devices(config_text: str, count: int) -> tuple:
    from jax.experimental import topologies
    _ensure_cuda_plugin(config_text)
    topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                        target_config=config_text)
    return tuple(topo.devices)


def target_devices(target: str, count: int) -> tuple:
    """`count` compile-only CUDA devices of one host (a node of `count` GPUs), e.g. to build
    the mesh of a tensor-parallel step (models/sharding.py make_mesh(tp, devices=...))."""
    return _devices(target_info(target).config_text, count)


def on_target(specs, target: str):
    """Attach the target device to a pytree of ShapeDtypeStructs (or arrays)."""
    sharding = jax.sharding.SingleDeviceSharding(target_device(target))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        specs)


@dataclasses.dataclass(frozen=True)
class KernelStats:
    name: str
    grid: tuple[int, ...]
    threads: tuple[int, ...]
    shared_memory_bytes: int  # per block, as launched (dynamic + static)
    registers: int | None  # per thread, from ptxas -v (None when no ptxas was found)
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    stack_frame_bytes: int | None
    mma_instructions: int  # mma.sync + wgmma in the kernel's PTX
    cp_async_instructions: int  # cp.async / cp.async.bulk (pipelined loads)


@dataclasses.dataclass(frozen=True)
class GpuCompileResult:
    target: str
    hlo: str  # optimized HLO
    ptx: dict[str, str]  # kernel entry name -> its PTX function text
    kernels: list[KernelStats]
    memory: object  # jax CompiledMemoryStats: argument/output/alias/temp bytes

    def kernel(self, prefix: str) -> KernelStats:
        found = [k for k in self.kernels if k.name.startswith(prefix)]
        if len(found) != 1:
            raise KeyError(f"{len(found)} kernels named {prefix}*: "
                           f"{[k.name for k in self.kernels]}")
        return found[0]


def find_ptxas() -> str | None:
    """The ptxas XLA would use: PATH, then the usual CUDA roots."""
    candidates = [shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"]
    try:
        import jax_plugins.xla_cuda12 as cuda_plugin  # pip-installed CUDA sits beside it
        base = Path(cuda_plugin.__file__).parent
        candidates += [str(base.parent / "nvidia/cuda_nvcc/bin/ptxas"),
                       str(base.parent.parent / "nvidia/cuda_nvcc/bin/ptxas")]
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


_PTXAS_FN = re.compile(
    r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads\n(?:.*\n)*?.*Used (\d+) registers")


def ptxas_report(ptx_text: str, arch: str) -> dict[str, tuple[int, int, int, int]]:
    """entry name -> (registers, spill store bytes, spill load bytes, stack frame bytes)."""
    ptxas = find_ptxas()
    if ptxas is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx_text)
        run = subprocess.run([ptxas, "-v", f"-arch={arch}", str(src), "-o", str(Path(d) / "k.o")],
                             capture_output=True, text=True, check=True)
    return {m.group(1): (int(m.group(5)), int(m.group(3)), int(m.group(4)), int(m.group(2)))
            for m in _PTXAS_FN.finditer(run.stderr)}


def _ptx_entries(ptx_text: str) -> dict[str, str]:
    """Split a PTX module into its `.entry` functions."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx_text)]
    ends = [s for s, _ in starts[1:]] + [len(ptx_text)]
    return {name: ptx_text[s:e] for (s, name), e in zip(starts, ends)}


_THUNK = re.compile(r"kCustomKernel|kKernel")
_THUNK_FIELDS = re.compile(r"\]\s+(\S+)\s+grid:\s*\[([\d, ]+)\]\s+threads:\s*\[([\d, ]+)\]\s+"
                           r"shared_memory:\s*(\d+)")


def compile_for_target(fn, args, target: str, *, fail_on_spills: bool = True
                       ) -> GpuCompileResult:
    """Compile `fn` (a jax.jit-wrapped function, or a plain one to wrap) for `target`.

    args: a pytree of ShapeDtypeStructs (shardings are replaced by the target device).
    Donation and static arguments are whatever `fn`'s own jax.jit says.
    """
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    return compile_lowered(jitted.trace(*on_target(args, target)).lower(), target,
                           fail_on_spills=fail_on_spills)


def compile_lowered(lowered, target: str, *, fail_on_spills: bool = True) -> GpuCompileResult:
    """Compile an already lowered function for `target` and read back what it holds. Its
    arguments carry their own shardings: one device of `target_device`, or a mesh of
    `target_devices` (then the HLO and kernels are those of one device's program)."""
    info = target_info(target)
    with tempfile.TemporaryDirectory() as dump:
        options = {"xla_dump_to": dump,
                   "xla_gpu_fail_ptx_compilation_on_register_spilling": fail_on_spills}
        compiled = lowered.compile(compiler_options=options)
        ptx_modules = [Path(p).read_text() for p in sorted(glob.glob(f"{dump}/*.ptx"))]
        thunks = "".join(Path(p).read_text()
                         for p in sorted(glob.glob(f"{dump}/*thunk_sequence.txt")))
    ptx: dict[str, str] = {}
    regs: dict[str, tuple[int, int, int, int]] = {}
    for module in ptx_modules:
        if module.strip():
            ptx.update(_ptx_entries(module))
            regs.update(ptxas_report(module, info.arch))
    kernels = []
    for line in thunks.splitlines():
        m = _THUNK_FIELDS.search(line)
        if not _THUNK.search(line) or m is None:
            continue
        name = m.group(1)
        body = ptx.get(name, "")
        r = regs.get(name, (None, None, None, None))
        kernels.append(KernelStats(
            name=name, grid=tuple(int(x) for x in m.group(2).split(",")),
            threads=tuple(int(x) for x in m.group(3).split(",")),
            shared_memory_bytes=int(m.group(4)), registers=r[0], spill_store_bytes=r[1],
            spill_load_bytes=r[2], stack_frame_bytes=r[3],
            mma_instructions=len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)", body)),
            cp_async_instructions=len(re.findall(r"\bcp\.async\b", body))))
    return GpuCompileResult(target=target, hlo=compiled.as_text(), ptx=ptx, kernels=kernels,
                            memory=compiled.memory_analysis())


def kernel_problems(result: GpuCompileResult, kernel: KernelStats, *,
                    expect_mma: bool = True) -> list[str]:
    """What would make `kernel` slow or unlaunchable on the target ([] when none)."""
    info = target_info(result.target)
    problems = []
    if kernel.shared_memory_bytes > info.shared_memory_per_block_optin:
        problems.append(f"{kernel.name}: {kernel.shared_memory_bytes} B shared memory > "
                        f"{info.shared_memory_per_block_optin} B available")
    if kernel.registers is None:
        problems.append(f"{kernel.name}: no ptxas report (ptxas not found)")
    else:
        if kernel.spill_store_bytes or kernel.spill_load_bytes:
            problems.append(f"{kernel.name}: spills {kernel.spill_store_bytes} B stores / "
                            f"{kernel.spill_load_bytes} B loads")
        if kernel.registers * math.prod(kernel.threads) > info.registers_per_block_limit:
            problems.append(f"{kernel.name}: {kernel.registers} registers x "
                            f"{math.prod(kernel.threads)} threads > block limit")
    if expect_mma and kernel.mma_instructions == 0:
        problems.append(f"{kernel.name}: no tensor-core (mma) instruction in its PTX")
    return problems


def full_cache_copies(result: GpuCompileResult, cache_specs) -> list[str]:
    """kernels/hlo_text.py `full_cache_copies` on a GPU compile."""
    return hlo_text.full_cache_copies(result.hlo, result.memory, cache_specs)
