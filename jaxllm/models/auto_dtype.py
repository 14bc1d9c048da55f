"""dtype="auto" on a CPU, decided by timing: bf16 or float32, whichever runs the model's own
decode GEMMs faster on this machine, measured once and remembered.

Why measure: a CPU flag says whether bf16 instructions exist, not whether XLA's bf16 GEMMs
beat its float32 ones. With avx512_bf16 and no AMX, bf16 ran 0.74x float32 on an Intel Xeon
and 1.5-2x on an AMD EPYC (the same flags on both).

The measurement: one decoder layer's projections (q, k, v, o, gate, up, down) at a decode
step of `rows` tokens, through the model's own `Linear` (f32 accumulation, models/layers.py),
stored and multiplied by the linear method the engine runs that dtype with
(kernels/linear_methods.py: the C++ GEMM or XLA's dot); the best of 15 runs per dtype, the
two interleaved (the best, not the median: another process on the machine only ever adds
time); a few ms each after compiling.
bfloat16 wins only when it is more than `BF16_MARGIN` faster: float32 is exact against HF
float32, so a near tie goes to it (and costs at most that margin).

The verdict is cached in `<cache root>/auto_dtype.json` (jaxllm/cache.py), keyed by the CPU
model, the jax and jaxlib versions, XLA_FLAGS, the linear methods and the GEMM shapes;
`cache_path=None` measures every time and stores nothing.

Owns the timing, the rule and the verdict cache. Never loads a checkpoint or touches an
accelerator (on one, "auto" is bfloat16 without measuring: models/dtype.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

BF16_MARGIN = 1.03  # bf16 must run the GEMMs at least 3% faster to be chosen
DECODE_ROWS = 64  # the decode step the verdict is for (a b64 step)
_REPEATS = 15


@dataclasses.dataclass(frozen=True)
class GemmShapes:
    """One decoder layer's projections at a decode step: [rows, in] x [in, out] each."""
    rows: int
    hidden: int
    intermediate: int
    q_width: int  # heads * head_dim
    kv_width: int  # kv heads * head_dim

    @classmethod
    def of(cls, cfg, rows: int = DECODE_ROWS) -> "GemmShapes":
        """From a models/config.py ModelConfig."""
        return cls(rows, cfg.hidden_size, cfg.intermediate_size,
                   cfg.num_attention_heads * cfg.head_dim,
                   cfg.num_key_value_heads * cfg.head_dim)

    def projections(self) -> list[tuple[int, int]]:
        """(in, out) of q, k, v, o, gate, up, down."""
        D, F, Q, K = self.hidden, self.intermediate, self.q_width, self.kv_width
        return [(D, Q), (D, K), (D, K), (Q, D), (D, F), (D, F), (F, D)]

    def key(self) -> str:
        return (f"rows={self.rows} hidden={self.hidden} intermediate={self.intermediate} "
                f"q={self.q_width} kv={self.kv_width}")


# SmolLM2-135M's, the default model's: what a verdict without a model (a benchmark's header)
# is measured on.
DEFAULT_SHAPES = GemmShapes(DECODE_ROWS, 576, 1536, 576, 192)


@dataclasses.dataclass(frozen=True)
class AutoDtypeVerdict:
    dtype: str  # "bfloat16" or "float32"
    bf16_ms: float  # one layer's GEMMs at shapes.rows rows, best of _REPEATS
    f32_ms: float
    shapes: GemmShapes
    source: str  # "measured" or "cached in <path>"

    def describe(self) -> str:
        if self.bf16_ms != self.bf16_ms:  # NaN: bf16 was never a candidate
            return f'dtype="auto" on this CPU is {self.dtype} [{self.source}]'
        return (f'dtype="auto" on this CPU is {self.dtype}: one layer\'s decode GEMMs '
                f"({self.shapes.key()}) take {self.bf16_ms:.2f} ms in bfloat16 and "
                f"{self.f32_ms:.2f} ms in float32 (bf16 {self.f32_ms / self.bf16_ms:.2f}x "
                f"f32; bf16 is chosen above {BF16_MARGIN:.2f}x) [{self.source}]")


def choose(bf16_ms: float, f32_ms: float) -> str:
    return "bfloat16" if bf16_ms * BF16_MARGIN < f32_ms else "float32"


def linear_methods_for(linear_backend: str | None = None, tensor_parallel_size: int = 1):
    """{dtype name: the linear method the engine would run it with} (kernels/
    linear_methods.py), for the dtypes that can run with `linear_backend` here."""
    from jaxllm.kernels.linear_methods import choose_linear_method

    methods = {}
    for name, dtype in (("bfloat16", jnp.bfloat16), ("float32", jnp.float32)):
        try:
            methods[name] = choose_linear_method(linear_backend, dtype, platform="cpu",
                                                 tensor_parallel_size=tensor_parallel_size)[0]
        except ValueError:  # an explicit linear_backend that cannot run this dtype here
            pass
    return methods


def _layer_fn(shapes: GemmShapes, dtype, method):
    """A jitted decoder layer's projections, as the model chains them, through the model's
    own Linear (models/layers.py), stored and multiplied as `method` does in the engine:
    q, k, v from x; o from q; down from gate * up."""
    from flax import nnx

    from jaxllm.models.layers import _linear

    linears = [_linear(i, o, False, dtype, nnx.Rngs(0)) for i, o in shapes.projections()]
    for layer in linears:
        layer.kernel = nnx.Param(method.process_weights_after_loading(layer.kernel[...]))
    graphdef, state = nnx.split(linears)

    @jax.jit
    def run(state, x_TD):
        q, k, v, o, gate, up, down = (functools.partial(method.apply, layer)
                                      for layer in nnx.merge(graphdef, state))
        return o(q(x_TD)) + down(gate(x_TD) * up(x_TD)), k(x_TD), v(x_TD)

    x_TD = jnp.asarray(np.random.default_rng(0).standard_normal(
        (shapes.rows, shapes.hidden), np.float32), dtype)
    return lambda: jax.block_until_ready(run(state, x_TD))


def time_gemms(shapes: GemmShapes, methods) -> tuple[float, float]:
    """(bf16 ms, f32 ms) through methods[dtype name]: the best of _REPEATS runs each, the two
    interleaved so drift hits both alike."""
    runs = {"bfloat16": _layer_fn(shapes, jnp.bfloat16, methods["bfloat16"]),
            "float32": _layer_fn(shapes, jnp.float32, methods["float32"])}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(_REPEATS + 2):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            if i >= 2:  # the first two compile and warm up
                times[name].append((time.perf_counter() - t0) * 1e3)
    return min(times["bfloat16"]), min(times["float32"])


def machine_key(shapes: GemmShapes, methods) -> str:
    import jaxlib

    from jaxllm.models.dtype import cpu_model

    linear = " ".join(f"{d}={m.name}" for d, m in methods.items())
    return (f"{cpu_model()} | jax {jax.__version__} jaxlib {jaxlib.__version__} | "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')} | linear {linear} | {shapes.key()}")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            entries = json.load(f)
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, entries: dict) -> None:
    """Atomically: engines starting side by side never read half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".auto_dtype-")
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def auto_dtype_verdict(shapes: GemmShapes = DEFAULT_SHAPES, cache_path: str | None = None,
                       linear_backend: str | None = None,
                       tensor_parallel_size: int = 1) -> AutoDtypeVerdict:
    """The cached verdict for this machine, these shapes and the linear methods the engine
    would run (EngineConfig.linear_backend), or a new measurement (stored when cache_path is
    given)."""
    methods = linear_methods_for(linear_backend, tensor_parallel_size)
    if "bfloat16" not in methods:
        return AutoDtypeVerdict("float32", float("nan"), float("nan"), shapes,
                                f'linear_backend="{linear_backend}" cannot run bfloat16 here')
    key = machine_key(shapes, methods)
    if cache_path is not None:
        entry = _read(cache_path).get(key)
        if isinstance(entry, dict) and entry.get("dtype") in ("bfloat16", "float32"):
            try:
                return AutoDtypeVerdict(entry["dtype"], float(entry["bf16_ms"]),
                                        float(entry["f32_ms"]), shapes,
                                        f"cached in {cache_path}")
            except (KeyError, TypeError, ValueError):
                pass  # a damaged entry is measured again and overwritten
    bf16_ms, f32_ms = time_gemms(shapes, methods)
    verdict = AutoDtypeVerdict(choose(bf16_ms, f32_ms), bf16_ms, f32_ms, shapes, "measured")
    if cache_path is not None:
        entries = _read(cache_path)
        entries[key] = {"dtype": verdict.dtype, "bf16_ms": bf16_ms, "f32_ms": f32_ms,
                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            _write(cache_path, entries)
        except OSError as e:
            logger.warning("could not store the dtype verdict in %s (%s): the next start "
                           "measures again", cache_path, e)
    return verdict


def verdict_cache_path() -> str:
    from jaxllm.cache import cache_root

    return os.path.join(cache_root(), "auto_dtype.json")


_logged: set[tuple] = set()


def log_once(verdict: AutoDtypeVerdict) -> None:
    """The choice and both figures, once per process and verdict (engines are built many
    times in one server or notebook)."""
    key = (verdict.dtype, verdict.shapes)
    if key not in _logged:
        _logged.add(key)
        logger.info(verdict.describe())
