"""A framework-free safetensors reader and writer (bfloat16 via ml_dtypes).

Owns: turning `*.safetensors` files into (name, numpy array) one tensor at a time. The
safetensors package's numpy backend has no bfloat16; the format (an 8-byte header length, a
JSON header, raw little-endian data) is short to read ourselves. Tensors are read into fresh
buffers rather than memory-mapped: a mapping keeps every page it touched resident until it
closes, which would hold a second copy of the checkpoint while the model fills.

The header is checked against the file's size before any tensor is read: a truncated file, a
header that does not parse, or offsets that disagree with a tensor's shape and dtype is a
ValueError naming the file, never a struct.error or a reshape error.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


# The format caps the JSON header at 100 MB; a larger length means the file is not safetensors.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_header(path: str) -> tuple[dict, int]:
    """-> (tensor name -> {dtype, shape, data_offsets}, byte offset of the data section)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file: it has {size} bytes, fewer "
                             f"than the 8-byte header length that starts one")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"{path} is truncated or not a safetensors file: its header "
                             f"length is {n} bytes, but only {size - 8} bytes follow")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is corrupt: its safetensors header is not valid JSON "
                         f"({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path} is corrupt: its safetensors header must be a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_entry(path, name, info, data_bytes=size - 8 - n)
    return header, 8 + n


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(path: str, name: str, info, data_bytes: int) -> None:
    """One header entry must describe bytes that exist and fit its shape and dtype exactly."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise ValueError(f"{path} is corrupt: header entry {name!r} needs dtype, shape and "
                         f"data_offsets, got {info!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype} "
                         f"(supported: {', '.join(_DTYPES)})")
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise ValueError(f"{path} is corrupt: tensor {name!r} has shape {shape!r}; a shape is "
                         f"a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
            and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{path} is corrupt: tensor {name!r} has data_offsets {offsets!r}; "
                         f"they must be [start, end] with 0 <= start <= end")
    start, end = offsets
    if end > data_bytes:
        raise ValueError(f"{path} is truncated or corrupt: tensor {name!r} ends at byte {end} "
                         f"of the data section, but the file holds only {data_bytes} data bytes")
    want = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
    if end - start != want:
        raise ValueError(f"{path} is corrupt: tensor {name!r} ({dtype}, shape {shape}) needs "
                         f"{want} bytes, but its data_offsets [{start}, {end}] span "
                         f"{end - start}")


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, array) for every tensor in one file, in file order."""
    header, offset = read_header(path)
    with open(path, "rb") as f:
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, end = info["data_offsets"]
            f.seek(offset + start)
            raw = np.frombuffer(f.read(end - start), dtype=np.uint8)
            yield name, raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def dtype_name(dtype) -> str:
    """The safetensors name ("BF16", "F32", ...) of a numpy dtype."""
    names = {np.dtype(v): k for k, v in _DTYPES.items()}
    return names[np.dtype(dtype)]


def save_file(tensors: dict[str, np.ndarray], path: str) -> None:
    """Write a safetensors file (used by tests to build HF directories)."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        blob = arr.tobytes()
        header[name] = {"dtype": dtype_name(arr.dtype), "shape": list(arr.shape),
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
