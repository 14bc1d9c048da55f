"""A GGUF file's metadata and tensor table, read with numpy; tensor data memory-mapped.

Owns the GGUF container format (versions 2 and 3): the header, the metadata key/values, the
tensor infos and the data section's alignment. Why not `gguf.GGUFReader`: it builds a numpy
view for every element of every metadata array, which for Gemma 3's 262,144-token vocabulary
took 20 s; this reads the same file in 0.2 s. The tensors come out as `gguf.GGUFReader` gives
them (quantized ones as uint8 rows of blocks), for `gguf.quants.dequantize`. Never interprets
the metadata (models/gguf.py does) and never copies tensor data. Any malformed byte raises;
the caller (models/gguf.py `open_gguf`) names the file.

    | magic "GGUF" | version u32 | n_tensors u64 | n_kv u64 |
    | n_kv x (key: str, type: u32, value) |
    | n_tensors x (name: str, n_dims: u32, dims: n_dims x u64, type: u32, offset: u64) |
    | padding to `general.alignment` (32) | data: each tensor at its offset |
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml types stored as plain values (the rest are blocks of bytes).
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
          27: np.int64, 28: np.float64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any        # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (ggml's dims reversed)
    data: np.ndarray        # plain types: [*shape]; blocks: uint8 [*shape[:-1], row bytes]


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]  # arrays of numbers as lists, strings decoded
    tensors: list[GGUFTensor]

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at offset {self.pos} runs past the end")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.scalar("<I"), self.scalar("<Q")
            if item in (_STRING, _ARRAY):
                return [self.value(item) for _ in range(n)]
            fmt = _SCALARS[item]
            values = np.frombuffer(self.buf, np.dtype(fmt), count=n, offset=self.pos)
            self.pos += values.nbytes
            return values.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.scalar(_SCALARS[kind])


def read_gguf(path: str) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(blob))
    magic = bytes(cur.buf[:4])
    if magic != b"GGUF":
        raise ValueError(f"bad magic {magic!r}")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        infos.append((name, dims, GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        shape = tuple(int(d) for d in reversed(dims))
        block, type_size = GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count // block * type_size
        begin = start + offset
        if begin + nbytes > len(blob) or shape and shape[-1] % block:
            raise ValueError(f"tensor {name!r} ({kind.name}, shape {shape}) does not fit "
                             f"the file's {len(blob)} bytes")
        raw = blob[begin:begin + nbytes]
        if int(kind) in _PLAIN:
            data = raw.view(_PLAIN[int(kind)]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors.append(GGUFTensor(name, kind, shape, data))
    return GGUFFile(path, metadata, tensors)
