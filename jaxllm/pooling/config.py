"""Which pooling model a checkpoint is, and how it pools: read once from its directory.

Owns: the runner choice (vLLM's `runner` "auto" | "generate" | "pooling" and `convert`
"auto" | "none" | "embed" | "classify"; the deprecated `task` maps onto them), the pooling
architecture a checkpoint becomes (a `*ForCausalLM` with convert="embed" is its `*Model`),
its ModelConfig, and `PoolerConfig`: the engine's pooling task (vLLM's: the model's "embed"
or "classify", or with `pooler_config={"task": ...}` its token form), the pooling type
(sentence-transformers' `modules.json` + `1_Pooling/config.json` when present, else the
architecture's default; `pooler_config` may set it), normalization, the classifier's
activation, and matryoshka support. Never imports jax and never loads weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from jaxllm.config import CONVERTS, RUNNERS
from jaxllm.models.config import ModelConfig, architecture_of
# vLLM's deprecated `task` -> (runner, convert).
TASKS = {"auto": ("auto", "auto"), "generate": ("generate", "auto"),
         "embed": ("pooling", "embed"), "embedding": ("pooling", "embed"),
         "classify": ("pooling", "classify"), "score": ("pooling", "classify"),
         "encode": ("pooling", "auto")}
POOLING_TYPES = ("MEAN", "CLS", "LAST")
# The keys of vLLM's PoolerConfig that jaxllm applies (LLM(pooler_config=...), --pooler-config)
POOLER_CONFIG_KEYS = ("task", "pooling_type", "seq_pooling_type", "use_activation")
_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
_ENCODERS = ("BertModel", "BertForSequenceClassification")


def runner_and_convert(task: str | None, runner: str, convert: str) -> tuple[str, str]:
    """LLM(task=...) folded into (runner, convert), as vLLM's deprecated alias."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}")
    if task is None:
        return runner, convert
    if task not in TASKS:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {task!r}")
    t_runner, t_convert = TASKS[task]
    return (t_runner if runner == "auto" else runner,
            t_convert if convert == "auto" else convert)


def is_pooling_architecture(arch: str) -> bool:
    return arch in _ENCODERS or any(arch in (f"{f}Model", f"{f}ForSequenceClassification")
                                    for f in _FAMILIES)


def pooling_architecture(arch: str, convert: str) -> str:
    """The pooling model `arch` is served as: itself when it is one, else (convert "embed" or
    "classify") its family's `*Model` or `*ForSequenceClassification`."""
    if is_pooling_architecture(arch):
        return arch
    family = arch.removesuffix("ForCausalLM")
    if convert in ("auto", "none"):
        raise ValueError(f"{arch} is not a pooling model; pass convert='embed' or "
                         f"convert='classify' to use it as one")
    if arch.endswith("ForCausalLM") and family in _FAMILIES:
        return f"{family}Model" if convert == "embed" else f"{family}ForSequenceClassification"
    raise ValueError(f"convert={convert!r} is supported for the "
                     f"{', '.join(f + 'ForCausalLM' for f in _FAMILIES)} checkpoints, not {arch}")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    task: str                 # what the model is: "embed" or "classify"
    pooling_type: str         # POOLING_TYPES
    normalize: bool = True    # embeddings: L2-normalize by default
    activation: str | None = None  # classify: "softmax" or "sigmoid"
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    use_activation: bool = True  # classify: apply the activation unless a request says
    pooling_task: str | None = None  # what the engine pools (None: `task`), or "token_" + task

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got "
                             f"{self.pooling_type!r}")
        if self.pooling_task is None:
            object.__setattr__(self, "pooling_task", self.task)
        if self.pooling_task not in (self.task, f"token_{self.task}"):
            raise ValueError(f"pooler_config task must be one of "
                             f"{[f'token_{self.task}', self.task]} for this model, got "
                             f"{self.pooling_task!r}")

    @property
    def per_token(self) -> bool:
        """Whether the engine keeps every token's row (a token task) or one per prompt."""
        return self.pooling_task != self.task


def pooler_config_overrides(value) -> dict:
    """vLLM's pooler_config (a dict of its fields, or that dict as JSON, as `--pooler-config`
    gives it; None: nothing) -> the fields jaxllm applies; ValueError naming any other."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}: {e}") \
                from None
    if not isinstance(value, Mapping):
        raise ValueError(f"pooler_config must be a dict of vLLM's PoolerConfig fields, got "
                         f"{type(value).__name__}")
    unknown = sorted(set(value) - set(POOLER_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"pooler_config fields {unknown} are not supported; jaxllm applies "
                         f"{list(POOLER_CONFIG_KEYS)}")
    if value.get("use_activation") is not None and not isinstance(value["use_activation"],
                                                                   bool):
        raise ValueError(f"pooler_config use_activation must be a bool, got "
                         f"{value['use_activation']!r}")
    return {k: v for k, v in value.items() if v is not None}


def _read(path: str):
    with open(path) as f:
        return json.load(f)


def sentence_transformers_pooling(model_dir: str) -> tuple[str, bool] | None:
    """(pooling type, normalize) from modules.json and its Pooling module's config, or None
    when the directory is not a sentence-transformers model."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _read(modules_path)
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    if pooling is None:
        return None
    cfg = _read(os.path.join(model_dir, pooling.get("path", ""), "config.json"))
    modes = [mode for key, mode in (("pooling_mode_mean_tokens", "MEAN"),
                                    ("pooling_mode_cls_token", "CLS"),
                                    ("pooling_mode_lasttoken", "LAST")) if cfg.get(key)]
    others = [k for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                          "pooling_mode_weightedmean_tokens") if cfg.get(k)]
    if others or len(modes) != 1:
        raise ValueError(f"{model_dir}: sentence-transformers pooling "
                         f"{modes + others} is not supported; one of mean, cls, lasttoken is")
    return modes[0], normalize


def _num_labels(hf: Mapping[str, Any]) -> int:
    if isinstance(hf.get("num_labels"), int):
        return hf["num_labels"]
    labels = hf.get("id2label")
    return len(labels) if isinstance(labels, Mapping) and labels else 2  # HF's default


def read_pooling_model(model_dir: str, hf: Mapping[str, Any], convert: str,
                       pooler_config: Mapping | None = None
                       ) -> tuple[ModelConfig, PoolerConfig]:
    """The ModelConfig (its architecture the pooling one) and PoolerConfig of a checkpoint,
    with vLLM's `pooler_config` overrides (task, pooling type, use_activation) applied."""
    cfg, pooler = _read_pooling_model(model_dir, hf, convert)
    over = pooler_config_overrides(pooler_config)
    pooling_type = over.get("seq_pooling_type", over.get("pooling_type"))
    if pooling_type is not None:
        pooler = dataclasses.replace(pooler, pooling_type=str(pooling_type).upper())
    if "use_activation" in over:
        pooler = dataclasses.replace(pooler, normalize=over["use_activation"],
                                     use_activation=over["use_activation"])
    if "task" in over:
        pooler = dataclasses.replace(pooler, pooling_task=over["task"])
    return cfg, pooler


def _read_pooling_model(model_dir: str, hf: Mapping[str, Any], convert: str
                        ) -> tuple[ModelConfig, PoolerConfig]:
    arch = pooling_architecture(architecture_of(hf), convert)
    family = next((f for f in _FAMILIES if arch.startswith(f)), None)
    # A decoder's keys are read as its causal LM's (qk_norm for Qwen3, qkv bias for Qwen2).
    base = arch if family is None else f"{family}ForCausalLM"
    cfg = ModelConfig.from_hf_config({**hf, "architectures": [base]})
    classify = arch.endswith("ForSequenceClassification")
    cfg = dataclasses.replace(cfg, architecture=arch,
                              num_labels=_num_labels(hf) if classify else 0)
    if classify:
        sigmoid = cfg.num_labels == 1 or hf.get("problem_type") == "multi_label_classification"
        pooling_type = "CLS" if family is None else "LAST"
        return cfg, PoolerConfig("classify", pooling_type,
                                 activation="sigmoid" if sigmoid else "softmax")
    st = sentence_transformers_pooling(model_dir)
    pooling_type, normalize = st or ("CLS" if family is None else "LAST", True)
    dims = hf.get("matryoshka_dimensions")
    return cfg, PoolerConfig(
        "embed", pooling_type, normalize,
        is_matryoshka=bool(hf.get("is_matryoshka") or dims),
        matryoshka_dimensions=tuple(dims) if dims else None)





def wants_pooling_runner(model: str | None, runner: str, convert: str) -> bool:
    """vLLM's runner choice: "pooling" or "generate" as asked; "auto" pools when a convert is
    asked or the checkpoint's architecture is a pooling model. Looks only on this machine (a
    directory, the HF cache, a packaged model): a model found nowhere is the generative
    loader's to download or to report."""
    if runner != "auto":
        return runner == "pooling"
    if convert in ("embed", "classify"):
        return True
    if model is None:
        return False
    from jaxllm.models.packaged_hf import PACKAGED
    from jaxllm.models.resolve import _cached_snapshot

    if model in PACKAGED:
        return True
    folder = os.path.expanduser(model)
    if not os.path.isdir(folder):
        try:
            folder = _cached_snapshot(model)
        except Exception:  # not cached, or not a hub id: not ours to report
            return False
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return False
    try:
        hf = _read(path)
        return isinstance(hf, Mapping) and is_pooling_architecture(architecture_of(hf))
    except ValueError:  # not JSON, or no architecture: the generative loader says so, naming
        return False    # the file, as it does for any model


__all__ = ["PoolerConfig", "pooler_config_overrides", "read_pooling_model", "runner_and_convert", "wants_pooling_runner"]
