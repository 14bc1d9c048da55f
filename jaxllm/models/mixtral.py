"""The mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Owns: the family class (Llama's attention, norms and residual stream, models/llama.py, with
the feed-forward block of models/moe.py where the config makes a layer sparse) and its
checkpoint adapter, which stacks the per-expert tensors into the [E, ...] parameters.
Qwen2-MoE's q/k/v bias and shared expert and Qwen3-MoE's qk-norm are ModelConfig flags.
Never computes anything itself: the forward is Llama's.

Checkpoint names, for layer i (per expert e, HF stores each Linear [out, in]):

    Mixtral:     model.layers.i.block_sparse_moe.gate.weight           [E, D]
                 model.layers.i.block_sparse_moe.experts.e.w1|w3.weight [F, D]  (gate, up)
                 model.layers.i.block_sparse_moe.experts.e.w2.weight   [D, F]  (down)
    Qwen-MoE:    model.layers.i.mlp.experts.e.gate_proj|up_proj|down_proj.weight
    transformers >= 5 in memory (state_dict), either family:
                 model.layers.i.mlp.experts.gate_up_proj [E, 2F, D], .down_proj [E, D, F]

all become model.layers.i.mlp.{gate.weight, experts.gate_up_proj [E, D, 2, F] (gate,
then up), experts.down_proj [E, F, D]}.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import numpy as np

from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.moe import moe_or_dense_mlp

_PER_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_OURS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
         "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


class MixtralForCausalLM(LlamaForCausalLM):
    """Also serves Qwen2MoeForCausalLM and Qwen3MoeForCausalLM (ModelConfig flags)."""

    mlp_for_layer = staticmethod(moe_or_dense_mlp)

    @classmethod
    def adapt_checkpoint(cls, cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]]
                         ) -> Iterator[tuple[str, np.ndarray]]:
        E = cfg.num_experts
        pending: dict[str, dict[tuple[str, int], tuple[str, np.ndarray]]] = {}
        for stored, tensor in tensors:
            name = stored.replace(".block_sparse_moe.", ".mlp.")
            fused = _FUSED.match(name)
            if fused and tensor.ndim == 3:
                prefix, which = fused.groups()
                if which == "down_proj":  # [E, D, F] -> [E, F, D]
                    yield f"{prefix}.down_proj", tensor.transpose(0, 2, 1)
                else:  # [E, 2F, D]: gate rows, then up rows -> [E, D, 2, F]
                    E_, F2, D = tensor.shape
                    yield (f"{prefix}.gate_up_proj",
                           tensor.reshape(E_, 2, F2 // 2, D).transpose(0, 3, 1, 2))
                continue
            one = _PER_EXPERT.match(name)
            if one is None:
                yield name, tensor
                continue
            prefix, e, which = one.group(1), int(one.group(2)), _OURS[one.group(3)]
            group = pending.setdefault(prefix, {})
            group[(which, e)] = (stored, tensor)
            if len(group) == 3 * E and all((w, i) in group for w in set(_OURS.values())
                                           for i in range(E)):
                del pending[prefix]
                # Each [out, in] -> [in, out]; gate and up side by side on a new axis.
                yield f"{prefix}.gate_up_proj", np.stack(
                    [np.stack([group[("gate_proj", i)][1].T, group[("up_proj", i)][1].T],
                              axis=1) for i in range(E)])
                yield f"{prefix}.down_proj", np.stack(
                    [group[("down_proj", i)][1].T for i in range(E)])
        # Incomplete expert sets: passed on under their checkpoint names, which the loader
        # reports as unexpected (and the stacked parameters as missing).
        for group in pending.values():
            yield from group.values()


__all__ = ["MixtralForCausalLM"]
