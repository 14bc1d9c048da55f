"""Checkpoint loading: every mismatch is a clear error naming the tensor, the architecture or
the path; a sharded HF directory (float32 or bfloat16 safetensors) round-trips to HF logits.

Malformed input, each a ValueError (or OSError) whose message names the file, never a bare
KeyError, struct.error or JSONDecodeError: config.json, generation_config.json and the shard
index (see _JSON_CASES), safetensors files (_SAFETENSORS_CASES), GGUF files (_GGUF_CASES);
and the same errors through `LLM(path)`. Last, the start-up KV budget error, which must never
report a negative block count or suggest a max_model_len <= 0.
"""

from __future__ import annotations

import json
import os
import re
import struct

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import hf_logits, hf_numpy_state, prefill_logits, tiny_hf_model

from jaxllm.config import EngineConfig
from jaxllm.models.config import ModelConfig
from jaxllm.models.gguf import load_gguf
from jaxllm.models.registry import supported_architectures
from jaxllm.models.safetensors_io import save_file
from jaxllm.models.weights import load_hf_dir, load_params
from jaxllm.runner.kv_cache import determine_num_blocks

TOKENS = [3, 17, 42, 5, 77, 1, 0, 63, 64, 12, 9]   # 11 tokens: crosses two 4-token blocks


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model("LlamaConfig", "LlamaForCausalLM", seed=3, vocab_size=80,
                         hidden_size=60, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                         max_position_embeddings=128)


@pytest.fixture(scope="module")
def cfg(hf_model):
    return ModelConfig.from_hf_config(hf_model.config.to_dict())


@pytest.fixture()
def state(hf_model):
    return hf_numpy_state(hf_model)


def _load(cfg, state):
    return load_params(cfg, state.items(), jnp.float32)


def test_missing_tensor_is_named(cfg, state):
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\."):
        _load(cfg, state)


def test_unexpected_tensor_is_named(cfg, state):
    state["model.layers.0.self_attn.o_proj.bias"] = np.zeros(60, np.float32)
    with pytest.raises(ValueError,
                       match=r"unexpected tensors: model\.layers\.0\.self_attn\.o_proj\.bias"):
        _load(cfg, state)


def test_wrong_shape_names_tensor_and_both_shapes(cfg, state):
    name = "model.layers.0.self_attn.k_proj.weight"   # HF [out, in] = [2 * 10, 60]
    state[name] = np.zeros((30, 60), np.float32)
    with pytest.raises(ValueError) as err:
        _load(cfg, state)
    msg = str(err.value)
    assert name in msg and "(30, 60)" in msg and "(60, 20)" in msg, msg


def test_every_problem_is_reported_at_once(cfg, state):
    del state["model.norm.weight"]
    state["model.extra.weight"] = np.zeros(3, np.float32)
    state["lm_head.weight"] = np.zeros((80, 61), np.float32)
    with pytest.raises(ValueError) as err:
        _load(cfg, state)
    msg = str(err.value)
    assert "model.norm.weight" in msg and "model.extra.weight" in msg and "lm_head.weight" in msg


def test_rope_buffers_are_ignored(cfg, state):
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(5, np.float32)
    _load(cfg, state)


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["GPT2LMHeadModel"], vocab_size=80, hidden_size=60, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=6)))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_hf_dir(str(tmp_path), jnp.float32)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: Model architecture ")
    for arch in supported_architectures():
        assert arch in str(err.value)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
            "Qwen3ForCausalLM"} <= set(supported_architectures())


def test_nonexistent_directory_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_hf_dir(missing, jnp.float32)


def _write_sharded(hf_model, state, model_dir):
    """Two shards, an index, and config.json, as `save_pretrained` lays them out."""
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: state[n] for n in part}, os.path.join(model_dir, file))
    index = {"metadata": {"total_size": sum(a.nbytes for a in state.values())},
             "weight_map": {n: f for f, part in shards.items() for n in part}}
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_model.config.to_dict(), f)


def test_sharded_directory_round_trip(hf_model, state, tmp_path):
    _write_sharded(hf_model, state, str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    model, cfg, gen = load_hf_dir(str(tmp_path), jnp.float32)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.head_dim == 10
    assert gen == {"temperature": 0.6}
    err = np.abs(prefill_logits(model, cfg, TOKENS) - hf_logits(hf_model, TOKENS)).max()
    assert err <= 1e-4


def test_index_naming_absent_shard_is_an_error(hf_model, state, tmp_path):
    _write_sharded(hf_model, state, str(tmp_path))
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_hf_dir(str(tmp_path), jnp.float32)


def test_bf16_safetensors(hf_model, state, tmp_path):
    bf16 = {n: a.astype(ml_dtypes.bfloat16) for n, a in state.items()}
    _write_sharded(hf_model, bf16, str(tmp_path))

    model16, _, _ = load_hf_dir(str(tmp_path), jnp.bfloat16)
    kernel = model16.model.layers[0].self_attn.q_proj.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kernel).T,
                                  bf16["model.layers.0.self_attn.q_proj.weight"])

    # Upcast on load: exactly HF with its weights rounded to bf16.
    model32, cfg, _ = load_hf_dir(str(tmp_path), jnp.float32)
    rounded = tiny_hf_model("LlamaConfig", "LlamaForCausalLM", seed=0,
                            **{k: getattr(hf_model.config, k) for k in (
                                "vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "max_position_embeddings")})
    rounded.load_state_dict({n: torch.from_numpy(a.astype(np.float32)) for n, a in bf16.items()})
    err = np.abs(prefill_logits(model32, cfg, TOKENS) - hf_logits(rounded, TOKENS)).max()
    assert err <= 1e-4


# ---- malformed JSON files of an HF directory ---------------------------------------------

def _write_dir(hf_model, state, model_dir) -> str:
    save_file(state, os.path.join(model_dir, "model.safetensors"))
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_model.config.to_dict(), f)
    return str(model_dir)


def _without(key):
    return lambda cfg: {k: v for k, v in cfg.items() if k != key}


# (id, file, new content: bytes, or a function of the valid config.json dict, message)
_JSON_CASES = [
    ("config_truncated", "config.json", b'{"hidden_size": 60,',
     "{path} is not valid JSON: Expecting property name enclosed in double quotes: line 1 "
     "column 20 (char 19)"),
    ("config_empty", "config.json", b"",
     "{path} is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("config_not_utf8", "config.json", b"\x80{}",
     "{path} is not valid JSON: 'utf-8' codec can't decode byte 0x80 in position 0: invalid "
     "start byte"),
    ("config_array", "config.json", b"[1, 2]", "{path} must hold a JSON object, got an array"),
    ("config_null", "config.json", b"null", "{path} must hold a JSON object, got null"),
    ("config_without_hidden_size", "config.json", _without("hidden_size"),
     "{path}: config key 'hidden_size' (an integer) is required but is missing"),
    ("config_null_vocab_size", "config.json", lambda cfg: {**cfg, "vocab_size": None},
     "{path}: config key 'vocab_size' (an integer) is required but is null"),
    ("config_string_layers", "config.json", lambda cfg: {**cfg, "num_hidden_layers": "2"},
     "{path}: config key 'num_hidden_layers' must be an integer, got '2'"),
    ("config_no_architectures_no_model_type", "config.json",
     lambda cfg: _without("model_type")(_without("architectures")(cfg)),
     "{path}: cannot pick a model class: config key 'architectures' is missing or empty and "
     "'model_type' is missing; set 'architectures' or use a supported 'model_type': 'llama' "
     "(LlamaForCausalLM), 'mistral' (MistralForCausalLM), 'mixtral' (MixtralForCausalLM), "
     "'qwen2' (Qwen2ForCausalLM), 'qwen2_moe' (Qwen2MoeForCausalLM), 'qwen3' "
     "(Qwen3ForCausalLM), 'qwen3_moe' (Qwen3MoeForCausalLM)"),
    ("generation_config_truncated", "generation_config.json", b'{"temperature":',
     "{path} is not valid JSON: Expecting value: line 1 column 16 (char 15)"),
    ("index_truncated", "model.safetensors.index.json", b'{"weight_map": {',
     "{path} is not valid JSON: Expecting property name enclosed in double quotes: line 1 "
     "column 17 (char 16)"),
    ("index_without_weight_map", "model.safetensors.index.json", b'{"metadata": {}}',
     "{path} needs a 'weight_map' object mapping tensor names to shard file names"),
    ("index_weight_map_array", "model.safetensors.index.json",
     b'{"weight_map": ["model.safetensors"]}',
     "{path} needs a 'weight_map' object mapping tensor names to shard file names"),
]


@pytest.mark.parametrize("file, content, message", [c[1:] for c in _JSON_CASES],
                         ids=[c[0] for c in _JSON_CASES])
def test_malformed_json_file_is_named(hf_model, state, tmp_path, file, content, message):
    model_dir = _write_dir(hf_model, state, tmp_path)
    path = os.path.join(model_dir, file)
    if callable(content):
        content = json.dumps(content(hf_model.config.to_dict())).encode()
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises(ValueError) as err:
        load_hf_dir(model_dir, jnp.float32)
    assert str(err.value) == message.format(path=path)


# ---- corrupt safetensors files ------------------------------------------------------------

def _safetensors_bytes(header, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


_F32_A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
# (id, file bytes, message)
_SAFETENSORS_CASES = [
    ("empty", b"", "{path} is not a safetensors file: it has 0 bytes, fewer than the 8-byte "
     "header length that starts one"),
    ("three_bytes", b"\x10\x00\x00", "{path} is not a safetensors file: it has 3 bytes, fewer "
     "than the 8-byte header length that starts one"),
    ("header_cut", _safetensors_bytes({"a": _F32_A}, bytes(8))[:30],
     "{path} is truncated or not a safetensors file: its header length is 61 bytes, but only "
     "22 bytes follow"),
    ("header_not_json", _safetensors_bytes(b"not json at all!"),
     "{path} is corrupt: its safetensors header is not valid JSON (Expecting value: line 1 "
     "column 1 (char 0))"),
    ("header_array", _safetensors_bytes([1]),
     "{path} is corrupt: its safetensors header must be a JSON object"),
    ("entry_without_offsets", _safetensors_bytes({"a": {"dtype": "F32", "shape": [2]}}),
     "{path} is corrupt: header entry 'a' needs dtype, shape and data_offsets, got "
     "{{'dtype': 'F32', 'shape': [2]}}"),
    ("data_cut", _safetensors_bytes(
        {"a": _F32_A, "b": {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]}},
        bytes(20))[:-5],
     "{path} is truncated or corrupt: tensor 'b' ends at byte 20 of the data section, but the "
     "file holds only 15 data bytes"),
    ("shape_larger_than_data", _safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8)),
     "{path} is corrupt: tensor 'a' (F32, shape [4]) needs 16 bytes, but its data_offsets "
     "[0, 8] span 8"),
    ("offsets_reversed", _safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8)),
     "{path} is corrupt: tensor 'a' has data_offsets [8, 0]; they must be [start, end] with "
     "0 <= start <= end"),
    ("negative_dim", _safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)),
     "{path} is corrupt: tensor 'a' has shape [-2]; a shape is a list of integers >= 0"),
    ("unsupported_dtype", _safetensors_bytes(
        {"a": {"dtype": "F8_E4M3", "shape": [8], "data_offsets": [0, 8]}}, bytes(8)),
     "{path}: tensor 'a' has unsupported dtype F8_E4M3 (supported: F64, F32, F16, BF16, I64, "
     "I32, I16, I8, U8, BOOL)"),
]


@pytest.mark.parametrize("content, message", [c[1:] for c in _SAFETENSORS_CASES],
                         ids=[c[0] for c in _SAFETENSORS_CASES])
def test_corrupt_safetensors_is_named(hf_model, state, tmp_path, content, message):
    model_dir = _write_dir(hf_model, state, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises(ValueError) as err:
        load_hf_dir(model_dir, jnp.float32)
    assert str(err.value) == message.format(path=path)


@pytest.mark.parametrize("keep, says", [
    (5, "is not a safetensors file: it has 5 bytes"),
    (100, "is truncated or not a safetensors file: its header length is "),
    (0.5, "is truncated or corrupt: tensor "),
    (-1, "is truncated or corrupt: tensor ")], ids=["length", "header", "half", "last_byte"])
def test_truncated_real_safetensors_is_named(hf_model, state, tmp_path, keep, says):
    """Cut the real checkpoint anywhere: in the length, the header, or the tensor data."""
    model_dir = _write_dir(hf_model, state, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError) as err:
        load_hf_dir(model_dir, jnp.float32)
    assert str(err.value).startswith(f"{path} {says}"), str(err.value)


def test_garbage_safetensors_is_named(hf_model, state, tmp_path):
    model_dir = _write_dir(hf_model, state, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    garbage = np.random.default_rng(0).bytes(4096)
    (length,) = struct.unpack("<Q", garbage[:8])
    assert length > 4088
    with open(path, "wb") as f:
        f.write(garbage)
    with pytest.raises(ValueError) as err:
        load_hf_dir(model_dir, jnp.float32)
    assert str(err.value) == (f"{path} is truncated or not a safetensors file: its header "
                              f"length is {length} bytes, but only 4088 bytes follow")


# ---- corrupt GGUF files -------------------------------------------------------------------

_GGUF_META = {"block_count": 1, "embedding_length": 8, "feed_forward_length": 12,
              "attention.head_count": 2, "attention.head_count_kv": 1, "context_length": 64,
              "vocab_size": 16}


def _write_gguf(path: str, **meta_overrides) -> str:
    """A tiny llama GGUF in llama.cpp's tensor naming; a None override drops that key."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in {**_GGUF_META, **meta_overrides}.items():
        if value is not None:
            writer.add_uint32(f"llama.{key}", value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (16, 8), "output_norm.weight": (8,), "output.weight": (16, 8),
              "blk.0.attn_norm.weight": (8,), "blk.0.ffn_norm.weight": (8,),
              "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8),
              "blk.0.attn_v.weight": (4, 8), "blk.0.attn_output.weight": (8, 8),
              "blk.0.ffn_gate.weight": (12, 8), "blk.0.ffn_up.weight": (12, 8),
              "blk.0.ffn_down.weight": (8, 12)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_loads(tmp_path):
    """The base of the corruption cases below is itself valid."""
    _, cfg, _ = load_gguf(_write_gguf(str(tmp_path / "tiny.gguf")), jnp.float32)
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == (
        "LlamaForCausalLM", 1, 8)


@pytest.mark.parametrize("keep", [4, 10, 30, 200, 600, 0.5, -1], ids=lambda k: f"keep_{k}")
def test_truncated_gguf_is_named(tmp_path, keep):
    path = _write_gguf(str(tmp_path / "tiny.gguf"))
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError) as err:
        load_gguf(path, jnp.float32)
    assert str(err.value).startswith(
        f"{path} is truncated or corrupt: the GGUF reader failed with "), str(err.value)


@pytest.mark.parametrize("content, start", [(b"", b""), (b"GGU", b"GGU"),
                                            (b"GGUX" + bytes(60), b"GGUX"),
                                            (b"PK\x03\x04" + bytes(60), b"PK\x03\x04")],
                         ids=["empty", "three_bytes", "bad_magic", "zip_file"])
def test_not_a_gguf_file_is_named(tmp_path, content, start):
    path = str(tmp_path / "model.gguf")
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises(ValueError) as err:
        load_gguf(path, jnp.float32)
    assert str(err.value) == f"{path} is not a GGUF file: it starts with {start!r}, not b'GGUF'"


@pytest.mark.parametrize("override, message", [
    (dict(block_count=None), "GGUF metadata key 'llama.block_count' is missing"),
    (dict(embedding_length=None), "GGUF metadata key 'llama.embedding_length' is missing"),
    ({"attention.head_count": 0}, "GGUF metadata key 'llama.attention.head_count' must be >= 1, "
                                  "got 0"),
    (dict(vocab_size=None), "GGUF metadata has neither llama.vocab_size nor "
                            "tokenizer.ggml.tokens, so the vocabulary size is unknown")],
    ids=["no_block_count", "no_embedding_length", "zero_heads", "no_vocab"])
def test_gguf_metadata_problems_name_file_and_key(tmp_path, override, message):
    path = _write_gguf(str(tmp_path / "tiny.gguf"), **override)
    with pytest.raises(ValueError) as err:
        load_gguf(path, jnp.float32)
    assert str(err.value) == f"{path}: {message}"


# ---- the same errors through LLM(path) -----------------------------------------------------

def LLM(*args, **kwargs):  # noqa: N802  (imported late: the engine is not what most tests load)
    from jaxllm import LLM as _LLM

    # float32: the messages below count bytes per block, which "auto" would halve on a CPU
    # with bf16 matrix units.
    return _LLM(*args, **{"dtype": "float32", **kwargs})


def test_llm_names_a_truncated_config_json(hf_model, state, tmp_path):
    model_dir = _write_dir(hf_model, state, tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"hidden_size": 60,')
    with pytest.raises(ValueError) as err:
        LLM(model_dir, enforce_eager=True)
    assert str(err.value) == (f"{tmp_path / 'config.json'} is not valid JSON: Expecting "
                              f"property name enclosed in double quotes: line 1 column 20 "
                              f"(char 19)")


def test_llm_names_a_truncated_safetensors_file(hf_model, state, tmp_path):
    model_dir = _write_dir(hf_model, state, tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} is truncated or corrupt: "
                                         f"tensor "):
        LLM(model_dir, enforce_eager=True)


def test_llm_names_a_truncated_gguf_file(tmp_path):
    path = _write_gguf(str(tmp_path / "tiny.gguf"))
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(ValueError, match=f"^{re.escape(path)} is truncated or corrupt: the "
                                         f"GGUF reader"):
        LLM(path, enforce_eager=True)


# ---- a KV budget too small for one request -------------------------------------------------
# The tiny model: 2 layers x (K, V) x 16 tokens x 2 KV heads x head_dim 10 x 4 bytes (float32)
# = 5120 bytes per block; on CPU max_model_len = min(128, 2048) = 128 = 8 blocks of 16.

BLOCK_BYTES = 5120


@pytest.fixture(scope="module")
def tiny_dir(hf_model, tmp_path_factory) -> str:
    """The tiny model with a 80-token word-level tokenizer, enough for LLM() to start."""
    import tokenizers
    import transformers

    model_dir = tmp_path_factory.mktemp("tiny_kv")
    _write_dir(hf_model, hf_numpy_state(hf_model), model_dir)
    vocab = {f"w{i}": i for i in range(80)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="w0", eos_token="w1").save_pretrained(model_dir)
    return str(model_dir)


def _too_small(num_blocks: int, fix: str, budget: str) -> str:
    available = max(num_blocks - 1, 0)
    holds = "1 block" if num_blocks == 1 else f"{num_blocks} blocks"
    return (f"The KV cache is too small for one request of max_model_len=128: it needs 8 "
            f"blocks of block_size=16 tokens, but only {available} blocks are available. "
            f"The KV cache budget{budget} holds {holds} of {BLOCK_BYTES} bytes "
            f"each, and one block is always reserved as the null block. {fix}give the KV "
            f"cache at least 9 blocks: raise kv_cache_memory_bytes to at least "
            f"{9 * BLOCK_BYTES}, raise gpu_memory_utilization (on an accelerator), or set "
            f"num_gpu_blocks_override >= 9.")


def test_llm_with_a_one_byte_kv_budget(tiny_dir):
    with pytest.raises(ValueError) as err:
        LLM(tiny_dir, kv_cache_memory_bytes=1, enforce_eager=True)
    assert str(err.value) == _too_small(
        0, "No max_model_len fits in this budget; ", " of 1 bytes")


def test_llm_with_a_one_block_override(tiny_dir):
    with pytest.raises(ValueError) as err:
        LLM(tiny_dir, num_gpu_blocks_override=1, enforce_eager=True)
    assert str(err.value) == _too_small(1, "No max_model_len fits in this budget; ", "")


def test_llm_with_a_three_block_budget_suggests_a_positive_max_model_len(tiny_dir):
    with pytest.raises(ValueError) as err:
        LLM(tiny_dir, kv_cache_memory_bytes=3 * BLOCK_BYTES + 7, enforce_eager=True)
    assert str(err.value) == _too_small(
        3, "Lower max_model_len to at most 32, or ", f" of {3 * BLOCK_BYTES + 7} bytes")


def test_the_suggested_kv_budget_is_enough(tiny_dir):
    llm = LLM(tiny_dir, kv_cache_memory_bytes=9 * BLOCK_BYTES, enforce_eager=True,
              use_tqdm_on_load=False)
    assert llm.llm_engine.kv_cache_manager.num_blocks == 9


def test_determine_num_blocks_never_goes_negative(cfg):
    from jaxllm.runner.kv_cache import (DeviceMemory, StepMemory, kv_bytes_per_block,
                                        size_from_profile)

    # An accelerator whose memory the weights already exceed.
    full = DeviceMemory(bytes_limit=10**6, bytes_in_use=10**9)
    per_block = kv_bytes_per_block(cfg, 16, jnp.float32)
    for max_model_len in (None, 128):
        config = EngineConfig(max_model_len=max_model_len)
        sizing = size_from_profile(config, full, per_block, {(512, 8): StepMemory(1000, 0)})
        assert (sizing.num_blocks, sizing.kv_bytes) == (0, 0)
        if max_model_len is None:
            assert determine_num_blocks(config, cfg, jnp.float32, sizing=sizing) == 0
            continue
        with pytest.raises(ValueError, match=r"but only 0 blocks are available\. The KV "
                           r"cache budget of 0 bytes holds 0 blocks of 5120 bytes"):
            determine_num_blocks(config, cfg, jnp.float32, sizing=sizing)
