"""The engine's parameters saved with orbax, as the engine runs them, and restored as they were.

Owns the saved-state directory: what `LLM.save_sharded_state` writes and what
`LLM(model=<that directory>)` and `jaxllm serve <that directory>` restore.

    <dir>/
      config.json, generation_config.json   the checkpoint's (HF names, not the layout's)
      tokenizer files                        the tokenizer the engine served with
      state/                                 orbax (OCDBT, uncompressed): the parameters after
                                             process_weights_after_loading, in the engine's
                                             dtype, tensor-parallel layout and linear method's
                                             form; each device writes and reads its own shard
      jaxllm_state.json                      the StateKey, written last

A directory is written under a temporary name beside its final one and renamed into place, so
a reader never sees half of one; a directory without jaxllm_state.json is not a saved state.
Parameters are saved after packing, so that a restore is a read and nothing else (no cast, no
layout rewrite, no packing), and what is saved is exactly what ran, edits included. The
price: a state serves only its own key (dtype, tensor-parallel size, linear method and its
weight format, format version); a mismatch is a ValueError naming both values.

Why this complements the cache's safetensors copy of a GGUF (models/gguf_cache.py) and does
not replace it, nor sit beside it as a second automatic cache: measured on the default model
(SmolLM2-135M, 2-core EPYC, benchmarks/orbax_state.py), a start that restores a saved state
loaded in 1.4 s against 0.9 s from the safetensors copy (read, cast, packed: 3.2 s from the
GGUF itself). For a model this small, importing orbax and its per-array machinery cost more
than the cast and the packing they save, and a safetensors copy serves every tensor-parallel
size and linear method. A saved state is for what the copy cannot hold: parameters a user
changed, saved per device shard.

Must never: import orbax at module import (`import jaxllm` stays quick and quiet); restore a
state whose key differs from the one asked for; change a number on the way in or out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.kernels.linear_methods import LinearMethod
from jaxllm.models.config import ModelConfig
from jaxllm.models.resolve import SAVED_STATE_KEY_FILE as KEY_FILE
from jaxllm.models.sharding import Placement, logical_axes
from jaxllm.models.weights import abstract_model

FORMAT_VERSION = 1  # bump when what is written changes
STATE_DIR = "state"


@dataclasses.dataclass(frozen=True)
class StateKey:
    """What a saved state's numbers depend on, besides the checkpoint they came from."""

    dtype: str                  # "bfloat16", "float32", ...
    tensor_parallel_size: int   # the layout (models/tp_layout.py) follows from it and the config
    linear_method: str          # whose process_weights_after_loading the weights went through
    weight_format: str          # that method's stored form (LinearMethod.weight_format)
    format_version: int = FORMAT_VERSION

    @classmethod
    def of(cls, dtype, tensor_parallel_size: int, method: LinearMethod) -> "StateKey":
        return cls(jnp.dtype(dtype).name, tensor_parallel_size, method.name,
                   method.weight_format(jnp.dtype(dtype)))

    def mismatch(self, wanted: "StateKey") -> str | None:
        """'dtype bfloat16 (asked for float32), ...' for every field that differs, or None."""
        diffs = [f"{f.name} {getattr(self, f.name)!r} (asked for {getattr(wanted, f.name)!r})"
                 for f in dataclasses.fields(self)
                 if getattr(self, f.name) != getattr(wanted, f.name)]
        return ", ".join(diffs) or None


def is_saved_state(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, KEY_FILE))


def read_key(directory: str) -> StateKey:
    path = os.path.join(directory, KEY_FILE)
    with open(path) as f:
        raw = json.load(f)
    try:
        return StateKey(**raw)
    except TypeError as e:
        raise ValueError(f"{path} is not a jaxllm saved-state key: {e}") from e


@contextlib.contextmanager
def _orbax():
    """orbax.checkpoint, its INFO lines (through absl, into the "absl" logger: a dozen per
    save or restore, timings and file names) held back while it runs; its warnings pass."""
    import orbax.checkpoint as ocp

    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(max(level, logging.WARNING))
    try:
        yield ocp
    finally:
        absl_logger.setLevel(level)


def _checkpointer(ocp):
    """A synchronous checkpointer of parameter trees, OCDBT (one file set, not one per
    array), uncompressed: zstd saved a fifth of SmolLM2's bytes and made its restore take
    1.5-2x as long, and a restore is what a saved state is for."""
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_compression=False))


def save_state(directory: str, state, key: StateKey, hf_config: dict,
               generation_config: dict, tokenizer) -> None:
    """Write `state` (an nnx.State of the engine's parameters) and what serving it needs to
    `directory`, which must not exist yet (FileExistsError)."""
    directory = os.path.abspath(directory)
    if os.path.exists(directory):
        raise FileExistsError(f"{directory} already exists; save to a new directory")
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".partial-")
    try:
        with _orbax() as ocp, _checkpointer(ocp) as checkpointer:
            checkpointer.save(os.path.join(tmp, STATE_DIR),
                              args=ocp.args.PyTreeSave(nnx.to_pure_dict(state)))
        for name, value in (("config.json", hf_config),
                            ("generation_config.json", generation_config)):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(value, f)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, KEY_FILE), "w") as f:  # last: it marks the state whole
            json.dump(dataclasses.asdict(key), f)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def abstract_state(cfg: ModelConfig, dtype, placement: Placement, method: LinearMethod):
    """(graphdef, state) of the model as loaded and processed by `method`, its leaves
    ShapeDtypeStructs with the shardings a restore places them with. `cfg`: the checkpoint's
    config (the layout's follows from it)."""
    cfg = placement.layout(cfg).model_config
    model = abstract_model(cfg, dtype, build=lambda m: m.process_weights_after_loading(method))
    graphdef, state = nnx.split(model)
    replicated = NamedSharding(placement.mesh, PartitionSpec())
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        value = var.get_value()
        # A packed weight's rank is its method's (a method that packs runs without tensor
        # parallelism, so replicated over a 1-device mesh is where it lives).
        sharding = (placement.sharding(path) if len(logical_axes(path)) == value.ndim
                    else replicated)
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
    return graphdef, nnx.from_flat_state(flat)


class StateMismatch(ValueError):
    """A saved state whose arrays do not fit the model its config.json describes."""


def _check_fits(directory: str, saved, target) -> None:
    """StateMismatch unless the saved tree has the target's paths, shapes and dtypes."""
    def name(path) -> str:  # orbax's metadata keys a list's items by "0", the model by 0
        return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)

    flat_saved = {name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(saved)}
    wrong = []
    for path, want in jax.tree_util.tree_leaves_with_path(target):
        got = flat_saved.get(name(path))
        if got is None:
            wrong.append(f"{jax.tree_util.keystr(path)}: not saved")
        elif (tuple(got.shape), np.dtype(got.dtype)) != (want.shape, np.dtype(want.dtype)):
            wrong.append(f"{jax.tree_util.keystr(path)}: saved {np.dtype(got.dtype)}"
                         f"{list(got.shape)}, model {np.dtype(want.dtype)}{list(want.shape)}")
    if wrong or len(flat_saved) != len(jax.tree.leaves(target)):
        raise StateMismatch(f"the state saved in {directory} does not fit its config.json: "
                            + ("; ".join(wrong) or "it holds other arrays"))


def restore_state(directory: str, cfg: ModelConfig, dtype, placement: Placement,
                  method: LinearMethod):
    """The model saved in `directory`, placed on `placement`'s mesh. ValueError when its key
    is not this one's, or when its files cannot be read back (a half-written or damaged
    state), naming the directory and the cause."""
    directory = os.path.abspath(directory)  # orbax reads absolute paths only
    wanted = StateKey.of(dtype, placement.mesh.size, method)
    mismatch = read_key(directory).mismatch(wanted)
    if mismatch:
        raise ValueError(f"the state saved in {directory} was saved with {mismatch}; it can "
                         f"only be served as it was saved")
    graphdef, state = abstract_state(cfg, dtype, placement, method)
    target = nnx.to_pure_dict(state)
    path = os.path.join(directory, STATE_DIR)
    try:
        with _orbax() as ocp, _checkpointer(ocp) as checkpointer:
            # Shapes first, from the metadata: an orbax restore that fails half-way leaves
            # its asyncio tasks to die later, in whatever runs next.
            saved = checkpointer.metadata(path).item_metadata.tree
            _check_fits(directory, saved, target)
            restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding),
                                        target)
            restored = checkpointer.restore(
                path, args=ocp.args.PyTreeRestore(target, restore_args=restore_args))
        jax.block_until_ready(restored)
    except StateMismatch:
        raise
    except Exception as e:  # orbax and tensorstore raise many types for a damaged state
        raise ValueError(f"the state saved in {directory} cannot be restored "
                         f"({type(e).__name__}: {e})") from e
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
