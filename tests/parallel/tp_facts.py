"""Run in a subprocess with host devices: compile the runner's step for a model laid out
over `tp` devices and print, as one JSON line per case, what its optimized HLO holds (every
collective, the per-device caches, whole-cache copies). The tests in this directory assert
on these facts; a green token comparison would not show a gathered cache or weight.

    python tests/parallel/tp_facts.py CASES_JSON     (XLA_FLAGS sets the device count)
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import hlo_text
from jaxllm.kernels.backends import get_backend
from jaxllm.models.config import ModelConfig
from jaxllm.models.sharding import make_mesh
from jaxllm.runner.abstract_step import lower_abstract_step


def facts(case: dict) -> dict:
    cfg = ModelConfig.from_hf_config(case["config"])
    tp, backend = case["tp"], get_backend(case["backend"])
    step = lower_abstract_step(cfg, make_mesh(tp), backend, T=case["T"], S=case["S"],
                               W=case["W"], num_blocks=case["num_blocks"],
                               dtype=jnp.dtype(case["dtype"]))
    compiled = step.lowered.compile()
    hlo = compiled.as_text()
    cache = step.kv_caches[0][0]
    local = cache.sharding.shard_shape(cache.shape)
    cache_bytes = math.prod(local) * np.dtype(cache.dtype).itemsize
    history = step.token_ids
    weights = {tuple(x.shape) for x in jax.tree.leaves(step.state)}
    return dict(
        case=case["name"],
        collectives=[dataclasses.asdict(c) for c in hlo_text.collectives(hlo)],
        kv_heads=step.model_config.num_key_value_heads,
        cache_global=list(cache.shape), cache_local=list(local),
        kv_bytes_per_device=2 * len(step.kv_caches) * cache_bytes,
        donated_bytes=compiled.memory_analysis().alias_size_in_bytes,
        history_bytes=math.prod(history.shape) * 4,
        cache_copies=hlo_text.full_cache_copies(hlo, compiled.memory_analysis(),
                                                step.kv_caches),
        weight_shapes=sorted(list(s) for s in weights),
        padded_vocab=step.model_config.num_embeddings,
    )


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        print(json.dumps(facts(case)), flush=True)
