"""Model name -> files: local paths, the HF cache first, the hub only when online, and the
embedded SmolLM2 GGUF for the default model. The hub is never reached here: every lookup is
forced offline, and an empty HF cache is used so the result does not depend on the machine."""

from __future__ import annotations

import os

import pytest

from jaxllm.models.resolve import DEFAULT_MODEL, embedded_default_gguf, resolve_model


@pytest.fixture(autouse=True)
def offline_empty_cache(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads its cache location at import; snapshot_download looks it up here.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_default_resolves_to_the_embedded_gguf():
    r = resolve_model(None)
    assert r.name == DEFAULT_MODEL and r.kind == "gguf"
    assert r.path == embedded_default_gguf() and r.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.getsize(r.path) > 50e6


def test_local_directory_and_gguf_file(tmp_path):
    assert resolve_model(str(tmp_path)).kind == "hf_dir"
    gguf = embedded_default_gguf()
    assert resolve_model(gguf) == resolve_model(gguf)  # frozen, comparable
    assert resolve_model(gguf).kind == "gguf"
    d, f = os.path.split(gguf)
    assert resolve_model(d, gguf_file=f).path == gguf


def test_nonexistent_path_is_named():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        resolve_model("/no/such/model")


def test_uncached_hub_id_offline_says_so():
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_model("some-org/not-a-cached-model")
