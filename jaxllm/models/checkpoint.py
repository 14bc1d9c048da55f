"""Resolved checkpoint -> (model, ModelConfig, generation config, tokenizer), the one load path.

Owns the order: a GGUF converted earlier (models/gguf_cache.py) loads like an HF directory,
in a fraction of the time; a GGUF seen for the first time is parsed once (weights and
tokenizer share the parse) and converted on the way; an HF directory loads as is. The
config alone can be read first (dtype="auto" on a CPU is timed at the model's shapes), and
a GGUF parsed for it is parsed once. Never decides the dtype or the placement: the engine
passes them.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxllm.models.config import ModelConfig
from jaxllm.models.gguf import gguf_to_hf_config, load_gguf, open_gguf
from jaxllm.models.gguf_cache import ConvertedWriter, find_converted
from jaxllm.models.resolve import ResolvedModel
from jaxllm.models.weights import load_hf_dir, read_model_config
from jaxllm.tokenizer import get_tokenizer, saved_tokenizer, tokenizer_from_gguf

CONVERTED_DTYPES = (jnp.bfloat16, jnp.float32)  # what dtype="auto" may pick on a CPU


def read_checkpoint_config(resolved: ResolvedModel, use_cache: bool = True):
    """-> (ModelConfig, the GGUF's parse or None), without loading weights: from the HF
    directory's config.json, a converted GGUF copy's (of any dtype), or else the GGUF's
    metadata, whose parse `load_checkpoint(reader=...)` then reuses."""
    if resolved.kind != "gguf":
        return read_model_config(resolved.path), None
    for dtype in CONVERTED_DTYPES if use_cache else ():
        converted = find_converted(resolved.path, dtype)
        if converted is not None:
            return read_model_config(converted), None
    reader = open_gguf(resolved.path)
    return ModelConfig.from_hf_config(gguf_to_hf_config(reader)), reader


def load_checkpoint(resolved: ResolvedModel, dtype, *, placement=None,
                    tokenizer: str | None = None, use_cache: bool = True, reader=None):
    """-> (model, ModelConfig, generation config dict, tokenizer). `tokenizer` names another
    tokenizer to use; `use_cache` reads and writes converted GGUF copies; `reader`: the
    GGUF's parse when read_checkpoint_config made one."""
    if resolved.kind != "gguf":
        model, cfg, gen = load_hf_dir(resolved.path, dtype, placement)
        return model, cfg, gen, get_tokenizer(tokenizer or resolved.path)
    converted = find_converted(resolved.path, dtype) if use_cache else None
    if converted is not None:
        model, cfg, gen = load_hf_dir(converted, dtype, placement)
        return model, cfg, gen, (get_tokenizer(tokenizer) if tokenizer
                                 else saved_tokenizer(converted))
    reader = reader or open_gguf(resolved.path)
    writer = ConvertedWriter(resolved.path, dtype) if use_cache else None
    try:
        model, cfg, gen = load_gguf(resolved.path, dtype, placement, reader=reader,
                                    tee=writer.tee if writer else None)
        gguf_tokenizer = tokenizer_from_gguf(resolved.path, reader=reader)
        if writer is not None:
            writer.commit(gguf_to_hf_config(reader), gen, gguf_tokenizer)
            writer = None
    finally:
        if writer is not None:
            writer.abandon()
    return model, cfg, gen, (get_tokenizer(tokenizer) if tokenizer else gguf_tokenizer)
