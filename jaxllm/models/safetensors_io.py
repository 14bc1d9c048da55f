"""A framework-free safetensors reader and writer (bfloat16 via ml_dtypes).

Owns: turning `*.safetensors` files into (name, numpy array) one tensor at a time. The
safetensors package's numpy backend has no bfloat16; the format (an 8-byte header length, a
JSON header, raw little-endian data) is short to read ourselves. Tensors are read into fresh
buffers rather than memory-mapped: a mapping keeps every page it touched resident until it
closes, which would hold a second copy of the checkpoint while the model fills.
"""

from __future__ import annotations

import json
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, array) for every tensor in one file, in file order."""
    header, offset = read_header(path)
    with open(path, "rb") as f:
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype "
                                 f"{info['dtype']}")
            start, end = info["data_offsets"]
            f.seek(offset + start)
            raw = np.frombuffer(f.read(end - start), dtype=np.uint8)
            yield name, raw.view(dtype).reshape(info["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str) -> None:
    """Write a safetensors file (used by tests to build HF directories)."""
    names = {np.dtype(v): k for k, v in _DTYPES.items()}
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        blob = arr.tobytes()
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
