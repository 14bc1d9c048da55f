"""GPT-2: OPT's decoder (models/opt.py) with GPT-2's flags and GPT-2's checkpoint layout.

Owns: turning a GPT-2 checkpoint into that decoder's parameters. GPT-2 stores its dense
layers as Conv1D, weight [in, out] (the transpose of a Linear's), and fuses q, k and v into
one `c_attn` [D, 3D] whose columns are q | k | v: it is split into q_proj, k_proj and v_proj
so that tensor parallelism shards each by heads like any other family (a fused kernel split
by columns would hand device 0 all of q). HF's `transformer.` prefix goes; the LM head is the
tied `wte` (the checkpoint has no lm_head.weight). The flags (learned positions at offset 0,
pre-norm, GELU-tanh, scale_attn_weights, scale_attn_by_inverse_layer_idx) come from
models/config_families.py. Never a network of its own.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import numpy as np

from jaxllm.models.config import ModelConfig
from jaxllm.models.opt import OPTForCausalLM, _rename

# GPT-2 name (after the prefix) -> ours; the Conv1D ones are transposed as well.
_GPT2_NAMES = [
    (r"^wte\.", "model.embed_tokens."),
    (r"^wpe\.", "model.embed_positions."),
    (r"^ln_f\.", "model.norm."),
    (r"^h\.(\d+)\.ln_1\.", r"model.layers.\1.input_layernorm."),
    (r"^h\.(\d+)\.ln_2\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^h\.(\d+)\.attn\.c_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^h\.(\d+)\.mlp\.c_fc\.", r"model.layers.\1.mlp.fc1."),
    (r"^h\.(\d+)\.mlp\.c_proj\.", r"model.layers.\1.mlp.fc2."),
]
_C_ATTN = re.compile(r"^h\.(\d+)\.attn\.c_attn\.(weight|bias)$")
_CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")
# Causal-mask buffers that old checkpoints saved beside the weights.
_BUFFERS = re.compile(r"\.attn\.(bias|masked_bias)$")


class GPT2LMHeadModel(OPTForCausalLM):
    @classmethod
    def adapt_checkpoint(cls, cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]]
                         ) -> Iterator[tuple[str, np.ndarray]]:
        for name, tensor in tensors:
            name = name.removeprefix("transformer.")
            if _BUFFERS.search(name):
                continue
            if _CONV1D.search(name):
                tensor = tensor.T  # Conv1D [in, out] -> a Linear's [out, in]
            fused = _C_ATTN.match(name)
            if fused:
                layer, leaf = fused.groups()
                for proj, part in zip("qkv", np.split(tensor, 3, axis=0)):
                    yield f"model.layers.{layer}.self_attn.{proj}_proj.{leaf}", part
                continue
            yield _rename(_GPT2_NAMES, name), tensor
