"""What research the engine can do (fixed per engine) and what one request asks of it.

Owns the static configuration `ResearchConfig` (LLM(research=...)), the request selectors
`Capture`, `Steer` and `Ablate` (read from `SamplingParams.extra_args`, vLLM's field for arguments its
own sampler does not read), their checks at admission (`ResearchLimits.check`: a ValueError
naming the argument and the allowed values) and what they change in the engine: a steered
or ablated request's prefix-cache key, and a capturing request's skipping of the prefix cache (a cached
position is never computed, so it could not be captured). Never imports jax: the engine
reads it. Never decides how a capture or a steer runs on the device (jaxllm/runner/features/).

Sites, in the order a decoder layer meets them (names as in TransformerLens' hook points):

    resid_pre -> norm -> q, k, v -> attention -> z -> o_proj = attn_out (+)
              -> norm -> MLP = mlp_out (+) -> resid_post
    (per layer; resid_pre of layer l + 1 is resid_post of layer l)
    [P, hidden_size] on the residual stream; q, k, v, z per head: q [P, heads, head_dim]
    and k, v [P, kv_heads, head_dim] after RoPE (q, k) as attention reads them, z
    [P, heads, head_dim] the attention output per head before o_proj
    final_norm: the model's last norm of the last layer's resid_post (no layer)

A steer adds alpha * vector to resid_post of its layer, for its request's rows only; a
capture of the same layer and site sees the steered value (HF: a forward hook on the
layer's output, then output_hidden_states).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

LAYER_SITES = ("resid_pre", "attn_out", "mlp_out", "resid_post", "q", "k", "v", "z")
MODEL_SITES = ("final_norm",)
CAPTURE_SITES = LAYER_SITES + MODEL_SITES
POSITION_SETS = ("all", "prompt", "generated")


def _int_tuple(value, name: str) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    try:
        out = tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {value!r}") from None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in out):
        raise ValueError(f"{name} must be a sequence of ints, got {value!r}")
    return tuple(int(v) for v in out)


def _sites(value, name: str, allowed: Sequence[str]) -> tuple[str, ...]:
    out = (value,) if isinstance(value, str) else tuple(value)
    bad = [s for s in out if s not in allowed]
    if bad:
        raise ValueError(f"{name} must be among {list(allowed)}, got {bad[0]!r}")
    return out


@dataclasses.dataclass(frozen=True)
class ResearchConfig:
    """What the compiled step can capture and steer, fixed per engine so that the buckets
    stay static. capture_layers x capture_sites (minus final_norm, which is captured once)
    are returned by every step; steer_layers each get a per-slot vector table, and
    ablate_layers a per-slot head mask and replacement. An empty config compiles nothing
    in."""

    capture_layers: tuple[int, ...] = ()
    capture_sites: tuple[str, ...] = ("resid_post",)
    steer_layers: tuple[int, ...] = ()
    ablate_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "capture_layers",
                           tuple(sorted(set(_int_tuple(self.capture_layers,
                                                       "research.capture_layers")))))
        object.__setattr__(self, "capture_sites",
                           tuple(dict.fromkeys(_sites(self.capture_sites,
                                                      "research.capture_sites",
                                                      CAPTURE_SITES))))
        for name in ("steer_layers", "ablate_layers"):
            object.__setattr__(self, name, tuple(sorted(set(_int_tuple(
                getattr(self, name), f"research.{name}")))))

    @property
    def capture_points(self) -> tuple[tuple[str, int | None], ...]:
        """(site, layer) of each captured value, in the order of the step's buffer."""
        layer_sites = [s for s in self.capture_sites if s in LAYER_SITES]
        points = [(s, layer) for layer in self.capture_layers for s in layer_sites]
        if "final_norm" in self.capture_sites and (self.capture_layers or not layer_sites):
            points.append(("final_norm", None))
        return tuple(points)

    @property
    def captures(self) -> bool:
        return bool(self.capture_points)


def point_name(site: str, layer: int | None) -> str:
    """The key of a captured value: "layers.{layer}.{site}", or the site of a model site."""
    return site if layer is None else f"layers.{layer}.{site}"


@dataclasses.dataclass(frozen=True)
class Capture:
    """A request's capture: which of the engine's layers and sites (None: all of them), and
    which token positions: "all", "prompt", "generated" or explicit positions. A generated
    token is computed (and captured) in the step after it is sampled, so the last one of a
    finished completion has no activations."""

    layers: tuple[int, ...] | None = None
    sites: tuple[str, ...] | None = None
    positions: str | tuple[int, ...] = "all"


@dataclasses.dataclass(frozen=True, eq=False)
class Steer:
    """Add alpha * vector ([hidden_size]) to resid_post of `layer`, for this request only."""

    layer: int
    vector: Any
    alpha: float = 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class Ablate:
    """Replace attention heads' outputs (z, before o_proj) at `layer` for this request:
    with zeros, or with `mean` ([len(heads), head_dim], e.g. the heads' mean z over a
    dataset, captured) for mean ablation."""

    layer: int
    heads: Sequence[int]
    mean: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class HeadAblation:
    """A checked Ablate: keep [heads] (1.0 keeps a head, 0.0 replaces it), fill
    [heads, head_dim] (what replaced heads become), and its prefix-cache key."""

    layer: int
    keep: np.ndarray
    fill: np.ndarray
    cache_key: tuple


@dataclasses.dataclass(frozen=True)
class CaptureSelection:
    """A checked Capture: the names it returns and its position filter."""

    names: tuple[str, ...]
    positions: str | frozenset[int]

    def keep(self, positions: np.ndarray, num_prompt_tokens: int) -> np.ndarray:
        """[N] bool: which of these positions the request asked for."""
        if self.positions == "all":
            return np.ones(positions.shape, bool)
        if self.positions == "prompt":
            return positions < num_prompt_tokens
        if self.positions == "generated":
            return positions >= num_prompt_tokens
        return np.isin(positions, list(self.positions))


@dataclasses.dataclass(frozen=True, eq=False)
class SteerVector:
    """A checked Steer: alpha * vector as float32, and the key its KV blocks are cached
    under (equal vectors, layers and alphas share blocks; nothing else does)."""

    layer: int
    delta: np.ndarray  # [hidden_size] float32, alpha * vector
    cache_key: tuple


def capture_of(params) -> CaptureSelection | None:
    return (getattr(params, "extra_args", None) or {}).get("_capture")


def steers_of(params) -> tuple[SteerVector, ...]:
    return (getattr(params, "extra_args", None) or {}).get("_steer", ())


def ablations_of(params) -> tuple[HeadAblation, ...]:
    return (getattr(params, "extra_args", None) or {}).get("_ablate", ())


def reads_prefix_cache(params) -> bool:
    """A capturing request computes every position (it could not capture a cached one)."""
    return capture_of(params) is None


def cache_extra_keys(params) -> tuple:
    """What a request's KV depends on besides its tokens: its steers and ablations."""
    return (tuple(s.cache_key for s in steers_of(params))
            + tuple(a.cache_key for a in ablations_of(params)))


class ResearchLimits:
    """One engine's research configuration and model dimensions: the admission checks."""

    def __init__(self, config: ResearchConfig | None = None, *, num_layers: int = 0,
                 hidden_size: int = 0, num_heads: int = 0, head_dim: int = 0):
        self.config = config or ResearchConfig()
        self.hidden_size = hidden_size
        self.num_heads, self.head_dim = num_heads, head_dim
        for name in ("capture_layers", "steer_layers", "ablate_layers"):
            bad = [layer for layer in getattr(self.config, name)
                   if not 0 <= layer < num_layers]
            if bad:
                raise ValueError(f"research.{name} must be in [0, {num_layers}) (the model's "
                                 f"layers), got {bad[0]}")

    def check(self, params) -> None:
        """Check and normalise params.extra_args' "capture", "steer" and "ablate" (params
        is the request's own copy); the checked forms are kept under "_capture", "_steer"
        and "_ablate"."""
        extra = getattr(params, "extra_args", None)
        if extra is None:
            return
        if not isinstance(extra, dict):
            raise ValueError(f"extra_args must be a dict, got {type(extra).__name__}")
        if "capture" in extra:
            extra["_capture"] = self._capture(extra["capture"])
        for key, check in (("steer", self._steer), ("ablate", self._ablate)):
            if key in extra:
                extra[f"_{key}"] = self._one_per_layer(key, extra[key], check)

    @staticmethod
    def _one_per_layer(key: str, value, check) -> tuple:
        """A Steer/Ablate or a list of them, checked; at most one per layer."""
        items = [value] if isinstance(value, (Steer, Ablate, dict)) else list(value)
        checked = tuple(check(item) for item in items)
        layers = [item.layer for item in checked]
        if len(set(layers)) != len(layers):
            raise ValueError(f"extra_args['{key}'] has two entries for layer "
                             f"{max(layers, key=layers.count)}; give one per layer")
        return checked

    def _capture(self, capture) -> CaptureSelection:
        if isinstance(capture, dict):
            capture = Capture(**capture)
        if not isinstance(capture, Capture):
            raise ValueError(f"extra_args['capture'] must be a jaxllm.research.Capture, got "
                             f"{type(capture).__name__}")
        cfg = self.config
        if not cfg.captures:
            raise ValueError("extra_args['capture'] needs an engine that captures: start it "
                             "with LLM(research=ResearchConfig(capture_layers=...))")
        layers = (cfg.capture_layers if capture.layers is None
                  else _int_tuple(capture.layers, "extra_args['capture'].layers"))
        bad = [layer for layer in layers if layer not in cfg.capture_layers]
        if bad:
            raise ValueError(f"extra_args['capture'].layers must be among the engine's "
                             f"capture_layers {list(cfg.capture_layers)}, got {bad[0]}")
        sites = (cfg.capture_sites if capture.sites is None
                 else _sites(capture.sites, "extra_args['capture'].sites", cfg.capture_sites))
        names = tuple(point_name(s, layer) for s, layer in cfg.capture_points
                      if s in sites and (layer is None or layer in layers))
        positions = capture.positions
        if isinstance(positions, str):
            if positions not in POSITION_SETS:
                raise ValueError(f"extra_args['capture'].positions must be one of "
                                 f"{list(POSITION_SETS)} or a sequence of ints, got "
                                 f"{positions!r}")
        else:
            positions = frozenset(_int_tuple(positions, "extra_args['capture'].positions"))
            if any(p < 0 for p in positions):
                raise ValueError(f"extra_args['capture'].positions must be >= 0, got "
                                 f"{min(positions)}")
        return CaptureSelection(names, positions)

    def _layer_request(self, value, key: str, cls, verb: str):
        """A Steer or Ablate (or a dict of its fields) whose layer the engine can act on."""
        if isinstance(value, dict):
            value = cls(**value)
        if not isinstance(value, cls):
            raise ValueError(f"extra_args['{key}'] must be a jaxllm.research.{cls.__name__} "
                             f"(or a list of them), got {type(value).__name__}")
        layers = getattr(self.config, f"{key}_layers")
        if not layers:
            raise ValueError(f"extra_args['{key}'] needs an engine that {verb}: start it "
                             f"with LLM(research=ResearchConfig({key}_layers=...))")
        if value.layer not in layers:
            raise ValueError(f"extra_args['{key}'].layer must be among the engine's "
                             f"{key}_layers {list(layers)}, got {value.layer!r}")
        return value

    def _steer(self, steer) -> SteerVector:
        steer = self._layer_request(steer, "steer", Steer, "steers")
        vector = np.asarray(steer.vector, np.float32)
        if vector.shape != (self.hidden_size,):
            raise ValueError(f"extra_args['steer'].vector must have shape "
                             f"({self.hidden_size},) (the hidden size), got {vector.shape}")
        alpha = float(steer.alpha)
        delta = (alpha * vector).astype(np.float32)
        if not np.isfinite(delta).all():
            raise ValueError("extra_args['steer']: alpha * vector must be finite")
        digest = hashlib.sha256(delta.tobytes()).hexdigest()[:32]
        return SteerVector(steer.layer, delta, ("steer", steer.layer, digest))

    def _ablate(self, ablate) -> HeadAblation:
        ablate = self._layer_request(ablate, "ablate", Ablate, "ablates")
        heads = _int_tuple(ablate.heads, "extra_args['ablate'].heads")
        N, H = self.num_heads, self.head_dim
        bad = [h for h in heads if not 0 <= h < N]
        if bad or not heads or len(set(heads)) != len(heads):
            raise ValueError(f"extra_args['ablate'].heads must be distinct heads in [0, {N}), "
                             f"got {list(heads)}")
        keep = np.ones(N, np.float32)
        keep[list(heads)] = 0.0
        fill = np.zeros((N, H), np.float32)
        if ablate.mean is not None:
            mean = np.asarray(ablate.mean, np.float32)
            if mean.shape != (len(heads), H):
                raise ValueError(f"extra_args['ablate'].mean must have shape "
                                 f"({len(heads)}, {H}) (heads, head_dim), got {mean.shape}")
            if not np.isfinite(mean).all():
                raise ValueError("extra_args['ablate'].mean must be finite")
            fill[list(heads)] = mean
        digest = hashlib.sha256(keep.tobytes() + fill.tobytes()).hexdigest()[:32]
        return HeadAblation(ablate.layer, keep, fill, ("ablate", ablate.layer, digest))
