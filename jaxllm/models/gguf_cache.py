"""GGUF checkpoints converted once, so that later starts skip GGUF parsing and dequantizing.

Owns the converted copy of a GGUF model in the cache (jaxllm/cache.py): an HF-style
directory (config.json, generation_config.json, model.safetensors in the model's dtype, the
tokenizer's files), keyed by the GGUF file's identity (real path, size, modification time)
and the dtype. A copy is written to a temporary directory and renamed into place, so a
reader never sees half of one. Never changes numbers: the tensors are the ones the GGUF
loader yields, cast to the dtype the model would cast them to anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile

import numpy as np

from jaxllm.cache import cache_root

FORMAT_VERSION = 1  # bump when what is written changes


def converted_dir(gguf_path: str, dtype) -> str:
    st = os.stat(gguf_path)
    key = json.dumps([FORMAT_VERSION, os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns,
                      np.dtype(dtype).name])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(cache_root(), "models", digest)


def find_converted(gguf_path: str, dtype) -> str | None:
    path = converted_dir(gguf_path, dtype)
    complete = all(os.path.exists(os.path.join(path, f))
                   for f in ("config.json", "model.safetensors", "tokenizer_config.json"))
    return path if complete else None


class ConvertedWriter:
    """Collects (hf_name, array) tensors as the GGUF loader yields them, writes them to disk
    one at a time (no second copy of the model in memory), then `commit`s the directory."""

    def __init__(self, gguf_path: str, dtype):
        self.final = converted_dir(gguf_path, dtype)
        os.makedirs(os.path.dirname(self.final), exist_ok=True)
        self.tmp = tempfile.mkdtemp(dir=os.path.dirname(self.final), prefix=".partial-")
        self.dtype = np.dtype(dtype)
        self._data = open(os.path.join(self.tmp, "data.bin"), "wb")
        self._header: dict = {}
        self._offset = 0

    def tee(self, tensors):
        """Pass (name, array) pairs through, writing each on the way."""
        from jaxllm.models.safetensors_io import dtype_name

        for name, arr in tensors:
            cast = np.ascontiguousarray(arr.astype(self.dtype))
            blob = cast.tobytes()
            self._header[name] = {"dtype": dtype_name(cast.dtype), "shape": list(cast.shape),
                                  "data_offsets": [self._offset, self._offset + len(blob)]}
            self._data.write(blob)
            self._offset += len(blob)
            yield name, arr

    def commit(self, hf_config: dict, generation_config: dict, tokenizer) -> None:
        self._data.close()
        raw = json.dumps(self._header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(self.tmp, "model.safetensors"), "wb") as out, \
                open(os.path.join(self.tmp, "data.bin"), "rb") as data:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            shutil.copyfileobj(data, out, 16 << 20)
        os.remove(os.path.join(self.tmp, "data.bin"))
        with open(os.path.join(self.tmp, "config.json"), "w") as f:
            json.dump(hf_config, f)
        with open(os.path.join(self.tmp, "generation_config.json"), "w") as f:
            json.dump(generation_config, f)
        tokenizer.save_pretrained(self.tmp)
        try:
            os.rename(self.tmp, self.final)
        except OSError:  # another process got there first: theirs is as good as ours
            shutil.rmtree(self.tmp, ignore_errors=True)

    def abandon(self) -> None:
        self._data.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
