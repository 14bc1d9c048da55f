"""EngineConfig: every knob `LLM(...)` takes, frozen and validated with ValueError.

Owns: defaults (which differ between CPU and accelerators, see below) and the range checks.
Never loads a model or touches a device beyond asking which platform jax runs on.

CPU defaults, chosen for a 2-core machine where each compiled bucket costs seconds:
  max_num_seqs 64, max_num_batched_tokens 512, max_model_len min(model max, 2048),
  KV cache 512 MiB (CPU_DEFAULT_KV_CACHE_BYTES; 22k tokens of SmolLM2-135M in bf16) unless
  kv_cache_memory_bytes is given.
Accelerator defaults follow vLLM: max_num_seqs 256, max_num_batched_tokens 8192,
  max_model_len = the model's, KV cache = gpu_memory_utilization of device memory.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxllm.cache import AUTO
from jaxllm.kernels import ATTENTION_BACKENDS, LINEAR_BACKENDS
from jaxllm.lora.config import lora_config_of
from jaxllm.research.requests import ResearchConfig
from jaxllm.sampling_params import LOGPROBS_MODES
from jaxllm.scheduling_policy import SCHEDULING_POLICIES
from jaxllm.spec_decode.config import SpeculativeConfig, speculative_config_of
from jaxllm.structured_outputs import StructuredOutputsConfig

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 29
CPU_DEFAULT_MAX_MODEL_LEN = 2048
_DTYPES = ("auto", "float32", "bfloat16", "float16")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner
CONVERTS = ("auto", "none", "embed", "classify")  # vLLM's --convert (a subset)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False  # compile buckets lazily instead of all at start-up
    # None: "pallas" on GPU; on CPU "cpu" when its C++ library is built and TP is 1, else "xla".
    attention_backend: str | None = None
    # None: "cpu" (the C++ GEMM on weights packed at load, kernels/linear_methods.py) on a
    # CPU with AVX-512 (AVX512-BF16 for bf16) when its library is built and TP is 1, else "xla".
    linear_backend: str | None = None
    # JAX's persistent compilation cache (and converted GGUF copies), by default under the
    # user's cache directory (jaxllm/cache.py; JAXLLM_CACHE_DIR moves it); None turns both off.
    compilation_cache_dir: str | None = AUTO
    max_logprobs: int = 20  # -1: no cap (the whole vocabulary); the sampler's static top-k
    # What logprobs hold (vLLM's modes): "raw_logprobs", "raw_logits", "processed_logprobs" or
    # "processed_logits" (after allowed ids, bad words, min_tokens, penalties, temperature,
    # min_p, top-k/top-p). Compiled into the step.
    logprobs_mode: str = "raw_logprobs"
    gguf_file: str | None = None
    tensor_parallel_size: int = 1  # devices on one "tp" mesh axis (Megatron layout)
    # Engine replicas behind one AsyncLLM / server, replica r on devices [r*tp, (r+1)*tp)
    # (jaxllm/async_llm.py); LLM(...) runs one engine and refuses more.
    data_parallel_size: int = 1
    # Several processes (nodes) as one engine on jax.distributed (jaxllm/distributed/):
    # vLLM's names. Every process passes the same arguments but node_rank; node 0 schedules.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # the leader's address: JAX's coordination service
    master_port: int = 29501
    # Schedule step N+1 while step N runs (vLLM's async scheduler); same outputs either way.
    # None (vLLM's default): on, unless an option that cannot run with it is set (then off,
    # with one warning); True with such an option is a ValueError, as in vLLM.
    async_scheduling: bool | None = None
    # Reuse the KV blocks of prompt prefixes already computed (vLLM v1's default: on).
    enable_prefix_caching: bool = True
    # Order of the waiting queue and choice of preemption victims (engine/request_queue.py):
    # "fcfs", or "priority" (lower `priority` first, then arrival; vLLM's).
    scheduling_policy: str = "fcfs"
    # Log a stats line every 10 s while there is work (engine/stat_logger.py). False here as
    # in vLLM's EngineArgs (so `jaxllm serve` logs); LLM(...) defaults to True, as vLLM's.
    disable_log_stats: bool = False
    # The largest `n` (samples of one request) admitted: vLLM's VLLM_MAX_N_SEQUENCES and its
    # default, here an engine argument (`--max-n-sequences`).
    max_n_sequences: int = 16384
    # What the compiled step can capture and steer (jaxllm.research.ResearchConfig, or its
    # fields as a dict); None: nothing, the step is the plain one.
    research: ResearchConfig | None = None
    # Which backend compiles grammars and fills their token masks (a StructuredOutputsConfig
    # or a dict of its fields, e.g. {"backend": "guidance"}; None: the default, "auto").
    structured_outputs_config: StructuredOutputsConfig | None = None
    # Pooling (jaxllm/pooling/): vLLM's runner "auto" | "generate" | "pooling" ("auto": what
    # the checkpoint's architecture is) and convert "auto" | "none" | "embed" | "classify"
    # (a causal LM served as an embedding or classification model).
    runner: str = "auto"
    convert: str = "auto"
    # vLLM's PoolerConfig fields, as a dict (pooling models only; jaxllm/pooling/config.py):
    # "task" (e.g. "token_embed"), "pooling_type" / "seq_pooling_type", "use_activation".
    pooler_config: dict | None = None
    # Speculative decoding (jaxllm/spec_decode/): a SpeculativeConfig or a dict of vLLM's
    # speculative_config fields, e.g. {"method": "ngram", "num_speculative_tokens": 4}.
    speculative_config: SpeculativeConfig | None = None
    # LoRA (jaxllm/lora/, vLLM's names and defaults): adapters per step (device slots),
    # their largest rank, adapters kept in host memory (None: max_loras), their dtype.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {CONVERTS}, got {self.convert!r}")
        object.__setattr__(self, "speculative_config",
                           speculative_config_of(self.speculative_config))
        self._resolve_async_scheduling()
        so = self.structured_outputs_config
        if so is None or isinstance(so, dict):
            if isinstance(so, dict) and set(so) - {"backend"}:
                raise ValueError(f"structured_outputs_config accepts the key 'backend', got "
                                 f"{sorted(set(so) - {'backend'})}")
            object.__setattr__(self, "structured_outputs_config",
                               StructuredOutputsConfig(**(so or {})))
        if not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            raise ValueError("structured_outputs_config must be a StructuredOutputsConfig, a "
                             f"dict of its fields or None, got {type(so).__name__}")
        if isinstance(self.research, dict):
            object.__setattr__(self, "research", ResearchConfig(**self.research))
        lora_config_of(self)  # the LoRA arguments' checks (ValueError)
        if self.research is not None and not isinstance(self.research, ResearchConfig):
            raise ValueError(f"research must be a jaxllm.research.ResearchConfig, a dict of "
                             f"its fields or None, got {type(self.research).__name__}")
        for name in ("model", "tokenizer", "gguf_file", "compilation_cache_dir", "master_addr"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        for name in ("seed", "block_size", "max_logprobs", "tensor_parallel_size",
                     "data_parallel_size", "nnodes", "node_rank", "master_port",
                     "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_memory_bytes", "num_gpu_blocks_override", "max_n_sequences"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an int, got {type(value).__name__}")
        for name in ("enforce_eager", "async_scheduling", "enable_prefix_caching",
                     "disable_log_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got "
                                 f"{type(getattr(self, name)).__name__}")
        if self.linear_backend is not None and self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS} (or None for the "
                             f"platform's default), got {self.linear_backend!r}")
        if self.attention_backend is not None and \
                self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} (or None "
                             f"for the platform's default), got {self.attention_backend!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                             f"{self.scheduling_policy!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_memory_bytes", "num_gpu_blocks_override", "max_n_sequences"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None for the default), got {value}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or >= 0, got "
                             f"{self.max_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got "
                             f"{self.logprobs_mode!r}")
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got "
                             f"{self.node_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size ({self.data_parallel_size}) > 1 with nnodes "
                             f"({self.nnodes}) > 1 is not supported: data parallelism runs "
                             "its replicas in one process")
        if (self.max_num_seqs and self.max_num_batched_tokens
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})")

    def _resolve_async_scheduling(self) -> None:
        """vLLM's rule: unset is on unless an option cannot run with it (then off, said once);
        asked for explicitly next to such an option, a ValueError."""
        blocker = None if self.speculative_config is None else (
            f"{self.speculative_config.method}-based speculative decoding")
        if self.async_scheduling is None:
            if blocker is not None:
                logger.warning("Async scheduling is not supported with %s and will be "
                               "disabled.", blocker)
            object.__setattr__(self, "async_scheduling", blocker is None)
        elif self.async_scheduling is True and blocker is not None:
            raise ValueError(f"async_scheduling=True cannot run with {blocker} here; pass "
                             "async_scheduling=False (--no-async-scheduling) or leave it unset")

    def resolved(self, model_max_len: int, on_accelerator: bool) -> "EngineConfig":
        """Fill the None defaults for this model and platform."""
        max_model_len = self.max_model_len or (
            model_max_len if on_accelerator else min(model_max_len, CPU_DEFAULT_MAX_MODEL_LEN))
        max_num_seqs = self.max_num_seqs or (256 if on_accelerator else 64)
        max_num_batched_tokens = self.max_num_batched_tokens or max(
            8192 if on_accelerator else 512, max_num_seqs)
        return dataclasses.replace(self, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
