"""Checkpoint tensors -> model parameters, through an explicit name map with shape checks.

Owns: the HF-name <-> parameter-path map, building the model abstractly (nnx.eval_shape) and
filling it one tensor at a time, and the HF-directory reader (config.json, single or sharded
safetensors, generation_config.json). Must never hold a second full copy of the weights:
each tensor is converted and placed on device, then its host buffer is dropped. Every
malformed file (JSON that does not parse or is not an object, a config missing a required key,
an index without a weight_map) is a ValueError naming its path.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.config import ModelConfig
from jaxllm.models.registry import get_model_class
from jaxllm.models.safetensors_io import iter_tensors

# Checkpoint tensors that carry no parameters (old Llama checkpoints store RoPE buffers).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_name(path: tuple) -> str:
    """('model', 'layers', 3, 'self_attn', 'q_proj', 'kernel') -> HF tensor name."""
    *mods, leaf = (str(p) for p in path)
    hf_leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    return ".".join(mods + [hf_leaf])


def linear_kernels(model) -> frozenset[tuple]:
    """Paths of the kernels of every nnx.Linear of `model` (abstract or real): the
    parameters a checkpoint stores [out, in] and nnx [in, out]."""
    return frozenset((*path, "kernel") for path, module in nnx.iter_modules(model)
                     if isinstance(module, nnx.Linear))


def to_param(path: tuple, tensor: np.ndarray, linear: frozenset[tuple]) -> np.ndarray:
    """HF layout -> our layout: linear weights (paths in `linear`) are stored [out, in],
    nnx kernels [in, out]; every other tensor as stored."""
    return tensor.T if path in linear else tensor


def family_tensors(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]]
                   ) -> Iterable[tuple[str, np.ndarray]]:
    """The checkpoint's tensors as the family's model names them. A family whose checkpoint
    names or layouts differ from its parameters (fused or per-expert tensors, Conv1D
    weights stored [in, out]) defines the classmethod `adapt_checkpoint(cfg, tensors)`,
    which yields (name, array) pairs with the model's dotted parameter paths
    (`hf_name`) and every nnx.Linear weight [out, in], as HF stores a Linear; the
    tensor-parallel layout (models/tp_layout.py) then reads those names."""
    adapt = getattr(get_model_class(cfg), "adapt_checkpoint", None)
    return tensors if adapt is None else adapt(cfg, tensors)


class _ShapeOnlyKeys:
    """Stands in for nnx.Rngs where only shapes are wanted: every stream (`rngs.params()`)
    yields one key. nnx.Rngs counts its draws in a variable, and under tracing each count
    update makes jax describe the tracer's origin by walking the whole trace so far: building
    SmolLM2-135M abstractly took 0.9 s with nnx.Rngs and 0.2 s with this."""

    def __init__(self):
        self._key = jax.random.key(0)

    def __call__(self):
        return self._key

    def __getattr__(self, stream: str):
        return self


def abstract_model(cfg: ModelConfig, dtype, build=None):
    """The model with ShapeDtypeStruct leaves: nothing allocated yet. build(model): what to
    do to it after construction, traced as well (a linear method's processing)."""
    cls = get_model_class(cfg)

    def make():
        model = cls(cfg, dtype=dtype, rngs=_ShapeOnlyKeys())
        if build is not None:
            build(model)
        return model

    return nnx.eval_shape(make)


def abstract_model_state(cfg: ModelConfig, dtype, placement=None):
    """(graphdef, state) of the model as `load_params` would build it with `placement`, its
    leaves ShapeDtypeStructs carrying their shardings: what compiling a step for a layout
    needs, with nothing allocated (tests, benchmarks/tp_plan.py)."""
    if placement is not None:
        cfg = placement.layout(cfg).model_config
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        value = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(
            value.shape, value.dtype,
            sharding=placement.sharding(path) if placement is not None else None))
    return graphdef, nnx.from_flat_state(flat)


def load_params(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], dtype,
                placement=None):
    """Build the model from (hf_name, array) pairs. Raises naming every missing, unexpected
    or misshapen tensor. `placement` (models/sharding.py Placement): the model is built in
    its tensor-parallel layout (the checkpoint tensors rewritten to it) and each parameter
    placed on its mesh; the model's config is then the layout's."""
    tensors = family_tensors(cfg, tensors)
    if placement is not None:
        layout = placement.layout(cfg)
        cfg, tensors = layout.model_config, layout.adapt(tensors)
    model = abstract_model(cfg, dtype)
    linear = linear_kernels(model)
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    by_name = {hf_name(path): path for path in flat}
    seen, unexpected, bad_shapes = set(), [], []
    for name, tensor in tensors:
        path = by_name.get(name)
        if path is None:
            if not (_IGNORED.match(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings)):
                unexpected.append(name)
            continue
        value = to_param(path, tensor, linear)
        want = flat[path].get_value()
        if tuple(value.shape) != tuple(want.shape):
            bad_shapes.append(f"{name}: checkpoint {tuple(tensor.shape)}, "
                              f"model expects {tuple(want.shape)} (as {tuple(want.shape)[::-1]}"
                              f" if stored [out, in])")
            continue
        arr = np.asarray(value, dtype=want.dtype)
        flat[path].set_value(jax.device_put(arr, placement.sharding(path))
                             if placement is not None else jnp.asarray(arr))
        seen.add(name)
    missing = sorted(set(by_name) - seen)
    if missing or unexpected or bad_shapes:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
        if bad_shapes:
            parts.append(f"wrong shapes: {'; '.join(bad_shapes)}")
        raise ValueError(f"checkpoint does not match {cfg.architecture}: " + " | ".join(parts))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---- HF directories ----------------------------------------------------------------------

def read_json(path: str) -> dict:
    """A JSON object from `path`; ValueError naming the path if it is not one."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        value = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for non-UTF-8 bytes
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
                float: "a number", type(None): "null"}[type(value)]
        raise ValueError(f"{path} must hold a JSON object, got {kind}")
    return value


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} needs a 'weight_map' object mapping tensor names to "
                             f"shard file names")
        files = [os.path.join(model_dir, s) for s in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not present: {absent}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_hf_dir_tensors(model_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    for path in safetensors_files(model_dir):
        yield from iter_tensors(path)


def read_model_config(model_dir: str) -> ModelConfig:
    """The directory's config.json as a ModelConfig, without touching weights; errors name
    the file."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{model_dir} has no config.json")
    hf_config = read_json(cfg_path)
    try:
        cfg = ModelConfig.from_hf_config(hf_config)
        get_model_class(cfg)  # an unsupported architecture fails here, naming the file
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from e
    return cfg


def load_hf_dir(model_dir: str, dtype, placement=None):
    """-> (model, ModelConfig, generation_config dict)."""
    cfg = read_model_config(model_dir)
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = read_json(gen_path) if os.path.exists(gen_path) else {}
    model = load_params(cfg, iter_hf_dir_tensors(model_dir), dtype, placement)
    return model, cfg, gen
