"""Compile jitted functions for an H100, A100, L4 or H200 without a GPU, and inspect the result.

Owns: finding a target's GpuTargetConfig text proto (packaged in `jaxllm/kernels/targets/`;
the `<name>.txtpb` files of the directory named by $JAXLLM_GPU_TARGETS add or override
targets), building a CUDA device from it, compiling through XLA's real GPU pipeline (Triton
kernels included) down to PTX and cubin, and reading back what a GPU run would depend on: the
optimized HLO, the PTX, and per kernel the launch shape, shared memory, registers and spills.
Also the check that a donated KV cache is updated in place (no full-cache copy). Must never:
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
import numpy as np

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
    from jax.experimental import topologies
    _ensure_cuda_plugin(config_text)
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                        target_config=config_text)
    return topo.devices[0]


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
    info = target_info(target)
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    specs = on_target(args, target)
    with tempfile.TemporaryDirectory() as dump:
        options = {"xla_dump_to": dump,
                   "xla_gpu_fail_ptx_compilation_on_register_spilling": fail_on_spills}
        compiled = jitted.trace(*specs).lower().compile(compiler_options=options)
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


# ------------------------------------------------------------ full-cache copy in a model step

_HLO_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64",
               "int8": "s8", "uint8": "u8", "int16": "s16", "uint16": "u16", "int32": "s32",
               "float8_e4m3fn": "f8e4m3fn",
               "float8_e5m2": "f8e5m2"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_IN_PLACE_OPS = ("scatter", "dynamic-update-slice")


def _arrays(hlo_type: str) -> list[tuple[str, int]]:
    """(dtype, element count) of each array in an HLO type (an array or a tuple)."""
    return [(dt, math.prod(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(hlo_type)]


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """computation name -> its instructions as (name, type, opcode, rest of line)."""
    comps: dict[str, list] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{\s*$", line)
        if head:
            current = comps.setdefault(("ENTRY " if line.startswith("ENTRY") else "")
                                       + head.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTR.match(line)):
            current.append(m.groups())
    return comps


def full_cache_copies(result: GpuCompileResult, cache_specs) -> list[str]:
    """Ways in which a compiled step touches the whole KV cache beyond in-place updates.

    cache_specs: the step's cache arguments (a pytree of arrays / ShapeDtypeStructs), which
    the step must take donated and return updated. "Cache-sized" means the dtype and element
    count of one cache array, so reshaped views count too. Returns [] when every cache-sized
    parameter is aliased to an output (donation took), no instruction copies a cache-sized
    array, and every fusion that produces a cache-sized array does so through a scatter or
    dynamic-update-slice (which XLA runs in place); otherwise one message per finding.

    Usage, for a whole model step (the lead's `runner/step.py`):

        step = jax.jit(step_fn, donate_argnames=("kv_caches",))
        result = compile_for_target(step, example_args, "h100")
        assert full_cache_copies(result, example_args_kv_caches) == []
    """
    leaves = jax.tree.leaves(cache_specs)
    cache_sized = {(_HLO_DTYPES[np.dtype(x.dtype).name], math.prod(x.shape)) for x in leaves}
    cache_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    comps = _computations(result.hlo)
    entry = next(instrs for name, instrs in comps.items() if name.startswith("ENTRY "))
    header = result.hlo.splitlines()[0]
    alias_text = re.search(r"input_output_alias=\{(.*?)\}, entry", header)
    aliased = {int(m) for m in re.findall(r"\{[\d,\s]*\}:\s*\((\d+),", alias_text.group(1))
               } if alias_text else set()
    problems = []
    params = [(int(rest.split(")")[0]), typ) for _, typ, op, rest in entry
              if op == "parameter" and set(_arrays(typ)) <= cache_sized]
    if len(params) < len(leaves):
        problems.append(f"found {len(params)} cache-sized parameters for {len(leaves)} caches")
    for number, typ in params:
        if number not in aliased:
            problems.append(f"parameter {number} ({typ.split('{')[0]}) is not aliased to an "
                            f"output: not donated, so the updated cache is a new buffer")
    for comp, instrs in comps.items():
        for name, typ, op, rest in instrs:
            if not cache_sized & set(_arrays(typ)):
                continue
            if op in ("copy", "copy-start"):
                problems.append(f"full-cache {op} %{name} ({typ.split('{')[0]}) in {comp}")
            elif op == "fusion":
                called = re.search(r"calls=%([\w.-]+)", rest).group(1)
                if not any(o in _IN_PLACE_OPS and cache_sized & set(_arrays(t))
                           for _, t, o, _ in comps.get(called, [])):
                    problems.append(f"fusion %{name} writes a cache-sized array with no "
                                    f"in-place scatter/dynamic-update-slice: a full pass")
    mem = result.memory
    if mem is not None and mem.alias_size_in_bytes < cache_bytes:
        problems.append(f"only {mem.alias_size_in_bytes} B aliased of {cache_bytes} B cache")
    return problems
