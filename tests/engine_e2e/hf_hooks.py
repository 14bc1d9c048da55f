"""HF transformers' activations at jaxllm's capture sites, from forward hooks (test helper).

resid_pre: a decoder layer's input; resid_post: its output; attn_out / mlp_out: the outputs
of its self_attn and mlp modules (before the residual adds); v: v_proj's output per KV
head; z: o_proj's input per head; final_norm: the model's norm. (q and k after RoPE have
no module to hook: the tests check them through attention patterns.)
"""

from __future__ import annotations

import numpy as np


def hf_sites(model, token_ids, steer=None) -> dict[str, np.ndarray]:
    """name -> [P, D] float32 from HF's forward over token_ids, with forward hooks; steer:
    (layer, delta) added to that layer's output first."""
    import torch

    found, handles = {}, []

    def keep(name):
        def hook(module, args, output):
            value = output[0] if isinstance(output, tuple) else output
            found[name] = value[0].detach().numpy().astype(np.float32)
        return hook

    def steer_hook(module, args, output):
        delta = torch.from_numpy(steer[1])
        if isinstance(output, tuple):
            return (output[0] + delta, *output[1:])
        return output + delta

    layers = model.model.layers
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, args, i=i: found.__setitem__(
                f"layers.{i}.resid_pre", args[0][0].detach().numpy().astype(np.float32))))
        if steer is not None and i == steer[0]:
            handles.append(layer.register_forward_hook(steer_hook))
        handles.append(layer.register_forward_hook(keep(f"layers.{i}.resid_post")))
        handles.append(layer.self_attn.register_forward_hook(keep(f"layers.{i}.attn_out")))
        handles.append(layer.mlp.register_forward_hook(keep(f"layers.{i}.mlp_out")))
        attn = layer.self_attn
        H = attn.head_dim
        handles.append(attn.v_proj.register_forward_hook(
            lambda m, args, out, i=i, H=H: found.__setitem__(
                f"layers.{i}.v", out[0].detach().numpy().reshape(out.shape[1], -1, H))))
        handles.append(attn.o_proj.register_forward_pre_hook(
            lambda m, args, i=i, H=H: found.__setitem__(
                f"layers.{i}.z", args[0][0].detach().numpy().reshape(args[0].shape[1], -1, H))))
    handles.append(model.model.norm.register_forward_hook(keep("final_norm")))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    return found
