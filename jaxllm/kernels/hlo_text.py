"""Reading an optimized HLO module's text: its computations, whole-KV-cache copies, and its
collectives.

Owns: the small parser of `compiled.as_text()` (computations and their instructions), the
check that a donated KV cache is updated in place (`full_cache_copies`), and the census of
cross-device collectives (`collectives`), which the tensor-parallel tests and
benchmarks/tp_plan.py read because a matching token stream does not show that a cache or
a weight was gathered. Works on any platform's HLO (CPU host devices, deviceless GPU
compiles). Must never compile or run anything itself.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

_HLO_DTYPES = {"bool": "pred", "bfloat16": "bf16", "float16": "f16", "float32": "f32",
               "float64": "f64", "int8": "s8", "uint8": "u8", "int16": "s16", "uint16": "u16",
               "int32": "s32", "uint32": "u32", "int64": "s64", "uint64": "u64",
               "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_IN_PLACE_OPS = ("scatter", "dynamic-update-slice")


def arrays(hlo_type: str) -> list[tuple[str, int]]:
    """(dtype, element count) of each array in an HLO type (an array or a tuple)."""
    return [(dt, math.prod(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(hlo_type)]


def computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
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


def full_cache_copies(hlo: str, memory, cache_specs) -> list[str]:
    """Ways in which a compiled step touches the whole KV cache beyond in-place updates.

    hlo: the optimized HLO (per device, for a partitioned program); memory: its
    `memory_analysis()` (or None). cache_specs: the step's cache arguments (a pytree of
    arrays / ShapeDtypeStructs, each compared at its per-device shard shape), which the step
    must take donated and return updated. "Cache-sized" means the dtype and element count of
    one cache array, so reshaped views count too (and so does any other array of that
    element count: compile with a block count no activation shares). Returns [] when every cache-sized
    parameter is aliased to an output (donation took), no instruction copies a cache-sized
    array, and every fusion that produces a cache-sized array does so through a scatter or
    dynamic-update-slice (which XLA runs in place); otherwise one message per finding.

    Usage, for a whole model step (runner/step.py):

        step = jax.jit(step_fn, donate_argnames=("kv_caches",))
        compiled = step.lower(*example_args).compile()
        assert full_cache_copies(compiled.as_text(), compiled.memory_analysis(),
                                 example_args_kv_caches) == []
    """
    leaves = jax.tree.leaves(cache_specs)
    shapes = [(np.dtype(x.dtype), _shard_shape(x)) for x in leaves]
    cache_sized = {(_HLO_DTYPES[dt.name], math.prod(shape)) for dt, shape in shapes}
    # Parameters arrive in their own shape: matched exactly (a weight may have a cache's
    # element count); inside the program reshaped views are matched by element count.
    cache_params = {(_HLO_DTYPES[dt.name], ",".join(map(str, shape))) for dt, shape in shapes}
    cache_bytes = sum(math.prod(shape) * dt.itemsize for dt, shape in shapes)
    comps = computations(hlo)
    entry = next(instrs for name, instrs in comps.items() if name.startswith("ENTRY "))
    header = hlo.splitlines()[0]
    alias_text = re.search(r"input_output_alias=\{(.*?)\}, entry", header)
    aliased = {int(m) for m in re.findall(r"\{[\d,\s]*\}:\s*\((\d+),", alias_text.group(1))
               } if alias_text else set()
    problems = []
    params = [(int(rest.split(")")[0]), typ) for _, typ, op, rest in entry
              if op == "parameter" and set(_ARRAY.findall(typ)) <= cache_params]
    if len(params) < len(leaves):
        problems.append(f"found {len(params)} cache-sized parameters for {len(leaves)} caches")
    for number, typ in params:
        if number not in aliased:
            problems.append(f"parameter {number} ({typ.split('{')[0]}) is not aliased to an "
                            f"output: not donated, so the updated cache is a new buffer")
    for comp, instrs in comps.items():
        for name, typ, op, rest in instrs:
            if not cache_sized & set(arrays(typ)):
                continue
            if op in ("copy", "copy-start"):
                problems.append(f"full-cache {op} %{name} ({typ.split('{')[0]}) in {comp}")
            elif op == "fusion":
                called = re.search(r"calls=%([\w.-]+)", rest).group(1)
                if not any(o in _IN_PLACE_OPS and cache_sized & set(arrays(t))
                           for _, t, o, _ in comps.get(called, [])):
                    problems.append(f"fusion %{name} writes a cache-sized array with no "
                                    f"in-place scatter/dynamic-update-slice: a full pass")
    if memory is not None and memory.alias_size_in_bytes < cache_bytes:
        problems.append(f"only {memory.alias_size_in_bytes} B aliased of {cache_bytes} B cache")
    return problems


def _shard_shape(x) -> tuple[int, ...]:
    sharding = getattr(x, "sharding", None)
    return tuple(sharding.shard_shape(x.shape)) if sharding is not None else tuple(x.shape)


# ------------------------------------------------------------------- collectives of a step

_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
                "reduce-scatter", "collective-broadcast", "ragged-all-to-all")
_BYTES = {hlo: jnp.dtype(name).itemsize for name, hlo in _HLO_DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # e.g. "all-reduce" (an async "-start" counts as its op; "-done" is not listed)
    dtype: str  # HLO dtype of the (first) result array, e.g. "f32"
    shape: tuple[int, ...]  # the result's per-device shape
    computation: str  # where it sits: "ENTRY ..." or a branch / loop body
    in_entry: bool

    @property
    def nbytes(self) -> int:
        """Bytes of the per-device result."""
        return math.prod(self.shape) * _BYTES[self.dtype]


def collectives(hlo: str) -> list[Collective]:
    """Every cross-device collective of an optimized (per-device) HLO module, in text order."""
    found = []
    for comp, instrs in computations(hlo).items():
        for _, typ, op, _ in instrs:
            base = op.removesuffix("-start")
            if base not in _COLLECTIVES:
                continue
            dtype, dims = _ARRAY.findall(typ)[-1 if op.endswith("-start") else 0]
            found.append(Collective(base, dtype, tuple(int(d) for d in dims.split(",") if d),
                                    comp, comp.startswith("ENTRY ")))
    return found
