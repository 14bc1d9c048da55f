"""Where jaxllm keeps what makes a second start fast: the one place that names the cache root.

    $JAXLLM_CACHE_DIR, else $XDG_CACHE_HOME/jaxllm, else ~/.cache/jaxllm
      xla/          JAX's persistent compilation cache (compiled steps)
      models/<key>/ GGUF checkpoints converted once to safetensors + tokenizer files
      auto_dtype.json  what dtype="auto" measured on this CPU (models/auto_dtype.py)

Owns the paths and turning JAX's compilation cache on. Never decides what is cached or how
it is keyed (callers do), and never deletes anything.
"""

from __future__ import annotations

import os

AUTO = "auto"  # EngineConfig.compilation_cache_dir default: <cache root>/xla


def cache_root() -> str:
    explicit = os.environ.get("JAXLLM_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxllm")


def compilation_cache_dir(setting: str | None) -> str | None:
    """The directory for JAX's persistent compilation cache: `setting` itself, the default
    under the cache root for "auto", or None (off)."""
    if setting is None:
        return None
    return os.path.join(cache_root(), "xla") if setting == AUTO else setting


def enable_compilation_cache(directory: str | None) -> None:
    """Turn JAX's persistent compilation cache on (every compile is cached: CPU compiles of
    a model step take seconds, and start-up compiles every bucket)."""
    if directory is None:
        return
    import jax

    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
