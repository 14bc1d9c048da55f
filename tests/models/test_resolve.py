"""Model name -> files: local paths, the HF cache first, the hub only when online, and the
embedded SmolLM2 GGUF for the default model. The hub is never reached here: every lookup is
forced offline, or "online" with the hub's API call replaced by a connection error, and an
empty HF cache is used so the result does not depend on the machine.

A hub id that cannot be used is a FileNotFoundError naming the id (never a ResolvedModel whose
path is None, which used to surface later as `TypeError: stat: path should be string...`)."""

from __future__ import annotations

import json
import os

import httpx2
import pytest

from jaxllm.models.resolve import (DEFAULT_MODEL, ResolvedModel, embedded_default_gguf,
                                   load_model, resolve_model)

HUB_ID = "someorg/some-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def offline_empty_cache(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads its cache location at import; snapshot_download looks it up here.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.fixture()
def online_without_network(monkeypatch):
    """HF_HUB_OFFLINE unset, and every hub API call fails as on a machine with no network."""
    import huggingface_hub.constants
    from huggingface_hub import HfApi

    def no_network(*args, **kwargs):
        raise httpx2.ConnectError("no network (test)")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "repo_info", no_network)
    monkeypatch.setattr(HfApi, "list_repo_tree", no_network)


def _partial_snapshot(tmp_path, with_tree_listing: bool = False) -> str:
    """A cached snapshot of HUB_ID holding tokenizer.json but no config.json, as an
    interrupted download leaves it; with the listing, the cache knows config.json is missing."""
    repo = tmp_path / "hub" / "models--someorg--some-model"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (snapshot / "tokenizer.json").write_text("{}")
    if with_tree_listing:
        (repo / "trees").mkdir()
        (repo / "trees" / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": {
            "config.json": {"size": 2, "blob_id": "a" * 40},
            "tokenizer.json": {"size": 2, "blob_id": "b" * 40}}}))
    return str(snapshot)


def test_default_resolves_to_the_embedded_gguf():
    r = resolve_model(None)
    assert r.name == DEFAULT_MODEL and r.kind == "gguf"
    assert r.path == embedded_default_gguf() and r.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.getsize(r.path) > 50e6


def test_embedded_gguf_standing_in_for_a_named_id_is_logged_once(caplog, tmp_path):
    from jaxllm.models import resolve

    resolve._warn_embedded_stands_in.cache_clear()
    with caplog.at_level("WARNING", logger="jaxllm.models.resolve"):
        resolve_model(None)  # the default, not asked for by name: nothing to say
        assert caplog.messages == []
        for _ in range(2):
            assert resolve_model(DEFAULT_MODEL).path == embedded_default_gguf()
    assert caplog.messages == [
        f"model '{DEFAULT_MODEL}' is not in the Hugging Face cache ({tmp_path / 'hub'}); "
        "using the embedded SmolLM2-135M-Instruct.Q4_1.gguf instead: Q4_1-quantized "
        "weights, dequantized, not the checkpoint's full-precision ones"]


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


def test_uncached_hub_id_offline_exact_message(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(HUB_ID)
    assert str(err.value) == (
        f"model '{HUB_ID}' is not a local path and is not in the Hugging Face cache "
        f"({tmp_path / 'hub'}), and HF_HUB_OFFLINE is set, so it cannot be downloaded")


def test_uncached_hub_id_without_network_names_the_id(tmp_path, online_without_network):
    """The reported bug: online mode, no network, nothing cached -> a path of None."""
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(HUB_ID)
    message = str(err.value)
    assert message.startswith(
        f"model '{HUB_ID}' is not a local path and is not in the Hugging Face cache "
        f"({tmp_path / 'hub'}), and it could not be downloaded from the hub (offline?): "
        f"LocalEntryNotFoundError: "), message
    assert "ConnectError: no network (test)" in message


def test_llm_with_uncached_hub_id_without_network(online_without_network):
    from jaxllm import LLM

    with pytest.raises(FileNotFoundError, match=f"^model '{HUB_ID}' is not a local path"):
        LLM(HUB_ID, enforce_eager=True)


def test_snapshot_without_config_json_offline(tmp_path):
    snapshot = _partial_snapshot(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(HUB_ID)
    assert str(err.value) == (
        f"model '{HUB_ID}' is not a local path and its Hugging Face cache snapshot "
        f"{snapshot} has no config.json, and HF_HUB_OFFLINE is set, so it cannot be downloaded")


def test_snapshot_without_config_json_without_network(tmp_path, online_without_network):
    # snapshot_download falls back to the partial cache when the hub cannot be reached.
    snapshot = _partial_snapshot(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(HUB_ID)
    assert str(err.value) == (
        f"model '{HUB_ID}': the Hugging Face snapshot {snapshot} has no config.json (the hub "
        f"could not be reached, or the repository has none; for a GGUF-only repository, pass "
        f"the path of a downloaded .gguf file)")


def test_incomplete_snapshot_offline(tmp_path):
    _partial_snapshot(tmp_path, with_tree_listing=True)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(HUB_ID)
    message = str(err.value)
    assert message.startswith(f"model '{HUB_ID}' is not a local path and its Hugging Face "
                              f"cache snapshot is incomplete ("), message
    assert "config.json" in message and message.endswith(
        "), and HF_HUB_OFFLINE is set, so it cannot be downloaded")


def test_incomplete_snapshot_without_network(tmp_path, online_without_network):
    _partial_snapshot(tmp_path, with_tree_listing=True)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(HUB_ID)
    message = str(err.value)
    assert message.startswith(
        f"model '{HUB_ID}' is not a local path and its Hugging Face cache snapshot is "
        f"incomplete ("), message
    assert "could not be downloaded from the hub (offline?): IncompleteSnapshotError" in message


@pytest.mark.parametrize("name", ["bad id!", "org/mo del"])
def test_invalid_hub_id(name):
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(name)
    assert str(err.value).startswith(
        f"model {name!r} is not a local path and not a valid Hugging Face hub id (")


def test_resolved_model_never_holds_a_missing_path():
    with pytest.raises(ValueError) as err:
        ResolvedModel("hf_dir", None, HUB_ID)
    assert str(err.value) == f"path of model '{HUB_ID}' must be a non-empty str, got None"
    with pytest.raises(ValueError) as err:
        ResolvedModel("zip", "/tmp/x", HUB_ID)
    assert str(err.value) == "kind must be one of ('hf_dir', 'gguf', 'saved_state'), got 'zip'"


def test_missing_gguf_file_in_a_directory_is_named(tmp_path):
    resolved = resolve_model(str(tmp_path), gguf_file="absent.gguf")
    with pytest.raises(FileNotFoundError) as err:
        load_model(resolved, None)
    assert str(err.value) == f"GGUF file {str(tmp_path / 'absent.gguf')!r} does not exist"


def test_vllm_quickstart_model_offline_says_it_cannot_be_downloaded(tmp_path):
    """vLLM's quickstart opens with LLM(model="facebook/opt-125m"): its architecture is
    supported, but offline and uncached its weights are not here, and the error says so."""
    from jaxllm import LLM
    from jaxllm.models.registry import supported_architectures

    assert "OPTForCausalLM" in supported_architectures()
    with pytest.raises(FileNotFoundError) as err:
        LLM(model="facebook/opt-125m")
    assert str(err.value) == (
        f"model 'facebook/opt-125m' is not a local path and is not in the Hugging Face cache "
        f"({tmp_path / 'hub'}), and HF_HUB_OFFLINE is set, so it cannot be downloaded")
