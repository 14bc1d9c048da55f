"""GGUF checkpoints: config from metadata, tensors dequantized and renamed to HF names.

Owns: llama.cpp's naming and layout conventions (tensor names, the Q/K row permutation its
converter applies to Llama-style models, Gemma's norms stored as 1 + w, Gemma's attention
facts its metadata leaves implicit). Reads with models/gguf_reader.py and dequantizes with the
`gguf` package (no torch); yields
HF-named float32 tensors one at a time so the caller never holds a second full copy. A file
that is not GGUF, is truncated, or lacks a metadata key we need is a ValueError naming the file
(the `gguf` reader itself fails on such bytes with IndexError, reshape errors and the like).
"""

from __future__ import annotations

import re
from typing import Iterator

import numpy as np

# general.architecture -> (HF architecture, whether llama.cpp permuted the q/k rows)
_ARCHS = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma": ("GemmaForCausalLM", False),
    "gemma2": ("Gemma2ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
}
_GEMMA = ("gemma", "gemma2", "gemma3")
# Gemma 2/3's four norms per layer (llama.cpp's ffn_norm is the norm before their MLP).
_SANDWICH_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_MAGIC = b"GGUF"


def open_gguf(path: str):
    """The file's parse (models/gguf_reader.py GGUFFile): open once, share with the tokenizer."""
    from jaxllm.models.gguf_reader import read_gguf

    with open(path, "rb") as f:  # a missing or unreadable file raises OSError naming it
        magic = f.read(len(_MAGIC))
    if magic != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, not {_MAGIC!r}")
    try:
        return read_gguf(path)
    except Exception as e:  # the reader indexes raw bytes: corrupt input fails in many ways
        raise ValueError(f"{path} is truncated or corrupt: the GGUF reader failed with "
                         f"{type(e).__name__}: {e}") from e


def _field(reader, key, default=None):
    return reader.get(key, default)


def _required_count(reader, key) -> int:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata key {key!r} is missing")
    if int(value) < 1:
        raise ValueError(f"GGUF metadata key {key!r} must be >= 1, got {value}")
    return int(value)


def gguf_to_hf_config(reader) -> dict:
    """A config.json-like dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(sorted(_ARCHS))})")
    p = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    need = lambda k: _required_count(reader, f"{arch}.{k}")  # noqa: E731
    names = {t.name for t in reader.tensors}
    tokens = reader.get("tokenizer.ggml.tokens")
    vocab = p("vocab_size") or (len(tokens) if tokens is not None else None)
    if not vocab:
        raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor "
                         f"tokenizer.ggml.tokens, so the vocabulary size is unknown")
    heads = need("attention.head_count")
    hidden = need("embedding_length")
    cfg = {
        "architectures": [_ARCHS[arch][0]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(p("attention.head_count_kv", heads)),
        "head_dim": int(p("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(p("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(p("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(p("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if "rope_freqs.weight" in names or p("rope.scaling.type") not in (None, "none"):
        # Llama 3.1 GGUFs precompute scaled frequencies into a tensor; we have not wired that.
        raise ValueError("GGUF files with RoPE scaling (rope_freqs / rope.scaling.*) are not "
                         "supported yet; load the HF safetensors checkpoint instead")
    if arch in _GEMMA:
        cfg.update(_gemma_config(arch, p, cfg))
        end_of_turn = _token_id(tokens, "<end_of_turn>")
        if end_of_turn is not None:  # a chat turn ends there (llama.cpp stops there too)
            cfg["eos_token_id"] = [cfg["eos_token_id"], end_of_turn]
    return cfg


def _token_id(tokens, text: str) -> int | None:
    try:
        return tokens.index(text) if tokens is not None else None
    except ValueError:
        return None


def _gemma_config(arch: str, p, cfg: dict) -> dict:
    """What HF's Gemma configs say that llama.cpp's metadata leaves implicit (llama.cpp's
    own defaults for these architectures)."""
    extra = {"model_type": {"gemma": "gemma", "gemma2": "gemma2",
                            "gemma3": "gemma3_text"}[arch],
             "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma":
        return extra
    layers, period = cfg["num_hidden_layers"], p("attention.sliding_window_pattern")
    if isinstance(period, list):  # newer files: one flag per layer, true = sliding
        types = ["sliding_attention" if flag else "full_attention" for flag in period]
    else:
        period = int(period or (2 if arch == "gemma2" else 6))
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                 for i in range(layers)]
    head_dim = cfg["head_dim"]
    # llama.cpp scales scores by head_dim ** -0.5, but hidden / heads for Gemma 2/3 27B
    # (HF's query_pre_attn_scalar: 144 and 168 there, the head dim elsewhere).
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if layers in (46, 62) \
        else head_dim
    extra.update(layer_types=types, sliding_window=int(p("attention.sliding_window", 4096)),
                 query_pre_attn_scalar=scalar,
                 final_logit_softcapping=p("final_logit_softcapping"))
    if arch == "gemma2":
        extra["attn_logit_softcapping"] = p("attn_logit_softcapping")
    else:  # Gemma 3's sliding layers: RoPE base 10000 (llama.cpp's and HF's default)
        extra.update(rope_theta=cfg["rope_theta"], rope_local_base_freq=10_000.0)
    return extra


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    names = {**_LAYER_NAMES, **_SANDWICH_NAMES} if arch in ("gemma2", "gemma3") else _LAYER_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of q/k rows (interleaved -> rotate-half RoPE).

    The converter stores, per head, rows [r0, r_h, r1, r_{h+1}, ...]; HF wants the two
    halves contiguous again: view rows as [head, pair, 2] and swap the last two axes back.
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def iter_gguf_tensors(reader, cfg: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (hf_name, float32 array in HF layout); unknown tensor names pass through
    unchanged so the loader reports them as unexpected."""
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    permuted = _ARCHS[arch][1]
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch) or t.name
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            w = unpermute_rows(w, n)
        if arch in _GEMMA and name.endswith("norm.weight"):
            w = w - np.float32(1)  # llama.cpp stores Gemma's norms as 1 + w (HF: w)
        yield name, w


def load_gguf(path: str, dtype, placement=None, reader=None, tee=None):
    """-> (model, ModelConfig, generation_config dict). `tee`: a generator function the
    (hf_name, array) tensors pass through on their way to the model (the converter)."""
    from jaxllm.models.config import ModelConfig
    from jaxllm.models.weights import load_params

    reader = reader if reader is not None else open_gguf(path)
    try:
        hf_cfg = gguf_to_hf_config(reader)
        cfg = ModelConfig.from_hf_config(hf_cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    gen = {"bos_token_id": hf_cfg["bos_token_id"], "eos_token_id": hf_cfg["eos_token_id"]}
    tensors = iter_gguf_tensors(reader, hf_cfg)
    model = load_params(cfg, tee(tensors) if tee else tensors, dtype, placement)
    return model, cfg, gen
