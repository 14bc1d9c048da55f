"""Phi-3: the Llama decoder, with Phi-3's fused projections split at load time.

Owns: turning a Phi-3 checkpoint into LlamaForCausalLM's parameters. Phi-3 fuses q, k and v
into `qkv_proj` (rows q | k | v: N*H, K*H, K*H) and gate and up into `gate_up_proj` (rows
gate | up); they are split into Llama's q/k/v_proj and gate/up_proj, so Phi-3 runs Llama's
modules, kernels, linear methods and tensor-parallel layout unchanged (a fused kernel split
by columns over devices would give one device all of q, another k and v). LongRoPE
(`rope_scaling` "longrope"/"su") and partial_rotary_factor are ModelConfig flags that
models/layers.py `Rope` reads. Never a network of its own.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import numpy as np

from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import LlamaForCausalLM

_QKV = re.compile(r"^(.*\.self_attn\.)qkv_proj\.weight$")
_GATE_UP = re.compile(r"^(.*\.mlp\.)gate_up_proj\.weight$")


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def adapt_checkpoint(cls, cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]]
                         ) -> Iterator[tuple[str, np.ndarray]]:
        q_rows = cfg.num_attention_heads * cfg.head_dim
        kv_rows = cfg.num_key_value_heads * cfg.head_dim
        for name, tensor in tensors:
            qkv, gate_up = _QKV.match(name), _GATE_UP.match(name)
            if qkv and tensor.shape[0] == q_rows + 2 * kv_rows:
                q, k, v = np.split(tensor, [q_rows, q_rows + kv_rows], axis=0)
                yield from ((f"{qkv.group(1)}{p}_proj.weight", t)
                            for p, t in zip("qkv", (q, k, v)))
            elif gate_up and tensor.shape[0] == 2 * cfg.intermediate_size:
                gate, up = np.split(tensor, 2, axis=0)
                yield f"{gate_up.group(1)}gate_proj.weight", gate
                yield f"{gate_up.group(1)}up_proj.weight", up
            else:  # a misshapen fused tensor is left whole: the loader names it
                yield name, tensor
