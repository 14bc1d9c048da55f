"""Resolved checkpoint -> (model, ModelConfig, generation config, tokenizer), the one load path.

Owns the order. For the engine (`load_for_engine`), whose parameters go through a linear
method's process_weights_after_loading: a saved state (models/saved_state.py, a directory
`LLM.save_sharded_state` wrote) is restored as is; a checkpoint is loaded as below, then
processed. Below that (`load_checkpoint`): a GGUF converted earlier (models/gguf_cache.py)
loads like an HF directory, in a fraction of the time; a GGUF seen for the first time is
parsed once (weights and tokenizer share the parse) and converted on the way; an HF
directory loads as is. The
config alone can be read first (dtype="auto" on a CPU is timed at the model's shapes), and
a GGUF parsed for it is parsed once. Never decides the dtype or the placement: the engine
passes them.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxllm.models.config import ModelConfig
from jaxllm.models.gguf import gguf_to_hf_config, load_gguf, open_gguf
from jaxllm.models.gguf_cache import ConvertedWriter, find_converted
from jaxllm.models.resolve import ResolvedModel
from jaxllm.models.saved_state import restore_state
from jaxllm.models.weights import load_hf_dir, read_json, read_model_config
from jaxllm.tokenizer import get_tokenizer, saved_tokenizer, tokenizer_from_gguf

CONVERTED_DTYPES = (jnp.bfloat16, jnp.float32)  # what dtype="auto" may pick on a CPU


@dataclasses.dataclass
class LoadedCheckpoint:
    model: object              # processed by the linear method it was loaded for
    model_config: ModelConfig  # the checkpoint's (the model's own is its layout's)
    generation_config: dict
    tokenizer: object          # the one to serve with
    source: str                # "checkpoint" or "saved state"


def load_for_engine(resolved: ResolvedModel, dtype, method, *, placement,
                    tokenizer: str | None = None, use_cache: bool = True,
                    reader=None) -> LoadedCheckpoint:
    """The model on `placement`, its weights in `method`'s form. `use_cache`: read and write
    the cache's converted GGUF copies."""
    if resolved.kind == "saved_state":
        return _restore(resolved.path, dtype, method, placement, tokenizer)
    model, cfg, gen, tok = load_checkpoint(resolved, dtype, placement=placement,
                                           tokenizer=tokenizer, use_cache=use_cache,
                                           reader=reader)
    model.process_weights_after_loading(method)
    return LoadedCheckpoint(model, cfg, gen, tok, "checkpoint")


def _restore(directory: str, dtype, method, placement,
             tokenizer: str | None) -> LoadedCheckpoint:
    cfg = read_model_config(directory)
    model = restore_state(directory, cfg, dtype, placement, method)
    gen_path = os.path.join(directory, "generation_config.json")
    gen = read_json(gen_path) if os.path.exists(gen_path) else {}
    tok = get_tokenizer(tokenizer) if tokenizer else saved_tokenizer(directory)
    return LoadedCheckpoint(model, cfg, gen, tok, "saved state")


def checkpoint_hf_config(resolved: ResolvedModel, dtype) -> dict:
    """The checkpoint's config.json as a dict (a GGUF's: its converted copy's, or else
    built from its metadata, which parses the file again)."""
    if resolved.kind == "gguf":
        converted = find_converted(resolved.path, dtype)
        if converted is None:
            return gguf_to_hf_config(open_gguf(resolved.path))
        return read_json(os.path.join(converted, "config.json"))
    return read_json(os.path.join(resolved.path, "config.json"))


def read_checkpoint_config(resolved: ResolvedModel, use_cache: bool = True):
    """-> (ModelConfig, the GGUF's parse or None), without loading weights: from the HF
    directory's config.json, a converted GGUF copy's (of any dtype), or else the GGUF's
    metadata, whose parse `load_checkpoint(reader=...)` then reuses."""
    if resolved.kind != "gguf":  # an HF directory or a saved state: its config.json
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
    if resolved.kind == "saved_state":
        raise ValueError(f"{resolved.path} is a saved state: load_for_engine restores it")
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
