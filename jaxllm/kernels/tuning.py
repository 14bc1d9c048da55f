"""Launch parameters of the paged-attention kernel, per GPU target.

Owns: the default tile sizes, warp counts, pipeline depths and KV-split policy of
`jaxllm/kernels/paged_attention.py`, and how a target name is found. Must never: depend on
runtime values; everything here is chosen from static shapes, so one jit trace makes one
choice.

Why two tile kinds: a decode token of a GQA model fills only G rows of a tile (G query heads
share one KV head), so decode-heavy batches use the smallest tensor-core tile (16 rows), while
prefill-heavy batches use taller tiles so that each K/V chunk is reused by more query rows.
The numbers were checked to compile with no register spill and within shared memory for both
targets in `tests/kernels/test_gpu_compile.py`; they are starting points, not autotuned.
Targets without measurements of their own (H200, L4) borrow the tiles of the closest tuned
family, with their own SM count.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int  # rows per tile = query tokens x query heads of one KV head; pow2, >= 16
    block_n: int  # keys per inner-loop step; pow2, >= 16
    num_warps: int
    num_stages: int  # software-pipelining depth of the K/V loads (Triton num_stages)


@dataclasses.dataclass(frozen=True)
class TargetTuning:
    num_sms: int  # streaming multiprocessors, to decide when to split the KV axis
    decode: TileConfig  # used when a batch has at most `decode_tokens_per_seq` tokens/seq
    prefill: TileConfig
    decode_tokens_per_seq: int = 2
    max_kv_splits: int = 16
    min_keys_per_split: int = 256  # a split shorter than this costs more to merge than it saves


# Keyed by target name. f32 tiles are chosen separately (see `tile_config`) because f32 K/V
# chunks take twice the shared memory per pipeline stage.
TARGETS: dict[str, TargetTuning] = {
    "h100": TargetTuning(
        num_sms=132,
        decode=TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3),
        prefill=TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
    ),
    "a100": TargetTuning(
        num_sms=108,
        decode=TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3),
        prefill=TileConfig(block_m=64, block_n=64, num_warps=8, num_stages=2),
    ),
    "default": TargetTuning(
        num_sms=80,
        decode=TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=2),
        prefill=TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ),
}
# H200: the H100 SXM's 132 Hopper SMs; only its memory is larger and faster.
TARGETS["h200"] = TARGETS["h100"]
# L4 (sm_89): the A100's instruction set for these kernels (mma.sync and cp.async, no wgmma),
# 58 SMs; the A100 tiles fit its 99 KB of shared memory per block (57 KB for the bf16 prefill
# tile at head_dim 128).
TARGETS["l4"] = dataclasses.replace(TARGETS["a100"], num_sms=58)

# f32 caches (tests, debugging): dots run as 3xTF32, which needs about three times the
# registers of a 16-bit tile; taller tiles spill on both targets, so f32 always uses this.
_F32_TILE = TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)


def detect_target() -> str:
    """The tuning-table key of the default JAX device ("default" when it is not a known GPU)."""
    import jax

    return target_of_device_kind(jax.devices()[0].device_kind)


def target_of_device_kind(kind: str) -> str:
    """The tuning key of a device kind, e.g. "NVIDIA H100 80GB HBM3" -> "h100".

    Whole words only: an "NVIDIA L40S" is not an L4.
    """
    for name in ("H100", "H200", "A100", "L4"):
        if re.search(rf"\b{name}\b", kind.upper()):
            return name.lower()
    return "default"


def tile_config(target: str, *, decode_heavy: bool, itemsize: int) -> TileConfig:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
    tt = TARGETS[target]
    if itemsize >= 4:
        return _F32_TILE
    return tt.decode if decode_heavy else tt.prefill


def num_kv_splits(target: str, *, busy_programs: int, max_context: int) -> int:
    """How many programs share one tile's keys, so that few long sequences still fill the GPU.

    busy_programs: an estimate of the programs with work in the unsplit grid.
    max_context: the static bound on keys per sequence (max_blocks_per_seq * block_size).
    """
    tt = TARGETS[target]
    if busy_programs >= tt.num_sms:
        return 1
    want = -(-tt.num_sms // max(busy_programs, 1))
    splits = min(want, tt.max_kv_splits, max_context // tt.min_keys_per_split)
    return splits if splits >= 2 else 1
