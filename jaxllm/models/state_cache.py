"""A GGUF's loaded parameters kept in the cache (jaxllm/cache.py), one saved state per layout.

Owns the cache entry's name: `states/<digest>`, the digest of the GGUF file's identity (real
path, size, modification time) and the StateKey (models/saved_state.py: dtype,
tensor-parallel size, linear method and its weight format, format version). Any of them
changing names another entry, so an entry is never served for a file or a layout it was not
saved from.

Why beside the safetensors copy of a GGUF (models/gguf_cache.py), not in its place: that copy
is portable (any tensor-parallel size, any linear method: it is the checkpoint, converted),
and reading it still costs the cast, the layout rewrite and the packing; a saved state is the
engine's parameters as they run, for one layout, restored with nothing left to do. A GGUF is
converted once, and saved once per layout it is served with; the cost is disk, a second copy
of the model per layout. `compilation_cache_dir=None` (no cache at all) turns both off.

Why GGUF files only: an HF directory is already a checkpoint in a format read at disk speed;
a copy of every hub model per layout would cost its size on disk to save the transposes and
the packing. `LLM.save_sharded_state` saves one when a user asks.

Never deletes an entry: a damaged one is reported (models/checkpoint.py) and left for the
user to delete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from jaxllm.cache import cache_root
from jaxllm.models.resolve import ResolvedModel
from jaxllm.models.saved_state import StateKey, is_saved_state


def checkpoint_identity(resolved: ResolvedModel) -> list:
    """[real path, size, mtime_ns] of the GGUF file."""
    if resolved.kind != "gguf":
        raise ValueError(f"only GGUF checkpoints have cached states, not {resolved.kind}")
    st = os.stat(resolved.path)
    return [os.path.realpath(resolved.path), st.st_size, st.st_mtime_ns]


def state_cache_dir(resolved: ResolvedModel, key: StateKey) -> str:
    raw = json.dumps([checkpoint_identity(resolved), dataclasses.asdict(key)])
    return os.path.join(cache_root(), "states", hashlib.sha256(raw.encode()).hexdigest()[:24])


def find_cached_state(resolved: ResolvedModel, key: StateKey) -> str | None:
    """The entry for `resolved` saved with `key`, if one was written whole."""
    path = state_cache_dir(resolved, key)
    return path if is_saved_state(path) else None
