"""LLMEngine: the request life cycle. add_request, then step() = schedule, execute, update.

Owns the wiring (model, tokenizer, KV cache size, scheduler, runner, output processor) and
the admission checks on each request. A request that fails its checks raises ValueError
before anything is added, so it never disturbs requests already in flight.
"""

from __future__ import annotations

import itertools
import logging
import time

import jax
import jax.numpy as jnp

from jaxllm.config import EngineConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.output_processor import OutputProcessor, ParentRequest
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import Scheduler
from jaxllm.kernels import default_attention_backend
from jaxllm.metrics import EngineMetrics
from jaxllm.models.gguf import open_gguf
from jaxllm.models.resolve import DEFAULT_MODEL, load_model, resolve_model
from jaxllm.models.sharding import make_mesh, param_sharding
from jaxllm.outputs import RequestMetrics, RequestOutput
from jaxllm.runner.buckets import BucketConfig
from jaxllm.runner.kv_cache import determine_num_blocks
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.runner.sampling_metadata import request_seed
from jaxllm.sampling_params import SamplingParams
from jaxllm.tokenizer import get_tokenizer, tokenizer_from_gguf

logger = logging.getLogger(__name__)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


class LLMEngine:
    def __init__(self, config: EngineConfig, use_tqdm: bool = True):
        if config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        accel = _on_accelerator()
        # "auto": float32 on CPU (XLA:CPU runs bf16 matmuls slower than f32), bfloat16 on
        # accelerators (what vLLM serves Llama checkpoints in).
        dtype = _DTYPES[config.dtype] if config.dtype != "auto" else (
            jnp.bfloat16 if accel else jnp.float32)
        resolved = resolve_model(config.model or DEFAULT_MODEL, gguf_file=config.gguf_file)
        t0 = time.perf_counter()
        reader = open_gguf(resolved.path) if resolved.kind == "gguf" else None
        mesh = make_mesh(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        model, mcfg, gen = load_model(resolved, dtype, reader=reader,
                                      sharding=param_sharding(mesh) if mesh else None)
        logger.info("loaded %s from %s in %.1f s", resolved.name, resolved.path,
                    time.perf_counter() - t0)
        if config.max_model_len and config.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is greater than the model's maximum "
                f"length ({mcfg.max_position_embeddings}); choose max_model_len <= "
                f"{mcfg.max_position_embeddings}")
        self.config = config = config.resolved(mcfg.max_position_embeddings, accel)
        self.model_config = mcfg
        if config.tokenizer:
            self.tokenizer = get_tokenizer(config.tokenizer)
        elif reader is not None:
            self.tokenizer = tokenizer_from_gguf(resolved.path, reader=reader)
        else:
            self.tokenizer = get_tokenizer(resolved.path)
        del reader
        self.eos_token_id = self.tokenizer.eos_token_id
        gen_eos = gen.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        # Extra EOS ids from generation_config act as stop tokens (as in vLLM).
        self.extra_eos_ids = [t for t in gen_eos if t != self.eos_token_id]

        num_blocks = determine_num_blocks(config, mcfg, dtype)
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size,
                                               config.max_model_len)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len)
        backend = config.attention_backend or default_attention_backend()
        max_blocks = -(-config.max_model_len // config.block_size)
        buckets = BucketConfig.create(config.max_num_batched_tokens, config.max_num_seqs,
                                      max_blocks, bucket_widths=backend == "xla")
        eos_ids = tuple(t for t in [self.eos_token_id, *self.extra_eos_ids] if t is not None)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=config.block_size,
                                  kv_dtype=dtype, buckets=buckets, attention_backend=backend,
                                  max_model_len=config.max_model_len, eos_token_ids=eos_ids,
                                  mesh=mesh)
        del model
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(resolved.name)
        self._request_counter = itertools.count()
        self._seed_counter = itertools.count()
        self.warmup_seconds = 0.0
        if not config.enforce_eager:
            t0 = time.perf_counter()
            self.runner.warmup(use_tqdm=use_tqdm)
            self.warmup_seconds = time.perf_counter() - t0

    # ---- admission ---------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        cfg = self.config
        if not prompt_token_ids:
            raise ValueError("The decoder prompt cannot be empty")
        if len(prompt_token_ids) > cfg.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the "
                f"maximum model length of {cfg.max_model_len}.")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary: prompt_token_ids must "
                             f"be in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > cfg.max_logprobs:
                raise ValueError(f"Requested {name} of {k}, which is greater than max allowed: "
                                 f"{cfg.max_logprobs}")

    def add_request(self, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate(prompt_token_ids, params)
        request_id = request_id or str(next(self._request_counter))
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}"
                                                         for i in range(params.n)]
        # Checked before adding anything: a duplicate would replace the live request's
        # output state.
        if any(c in self.scheduler.requests or c in self.output_processor.children
               for c in child_ids):
            raise ValueError(f"request_id {request_id!r} is already in flight: request ids "
                             "must be unique among unfinished requests")
        now = arrival_time or time.time()
        parent = ParentRequest(request_id, prompt, prompt_token_ids, params.n,
                               RequestMetrics(arrival_time=now))
        for index, child_id in enumerate(child_ids):
            child_params = self._child_params(params, index)
            self.output_processor.add_request(parent, child_id, index, child_params)
            self.scheduler.add_request(Request(child_id, prompt_token_ids, child_params,
                                               self.eos_token_id, now))
        return request_id

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        p = params.clone()
        # Every sequence gets a concrete seed: its own (shifted per child, so n > 1 samples
        # differ) or one derived from the engine seed, so a whole run is reproducible.
        if params.seed is not None:
            p.seed = params.seed + index
        else:
            p.seed = request_seed(self.config.seed, next(self._seed_counter))
        if not p.ignore_eos and self.extra_eos_ids:
            p.stop_token_ids = list(dict.fromkeys([*p.stop_token_ids, *self.extra_eos_ids]))
        return p

    def abort_request(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self.output_processor.abort(rid)

    # ---- the loop ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        engine_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        finished, stopped = self.output_processor.process_outputs(engine_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for out in finished:
            for c in out.outputs:
                self.metrics.record_finished(c.finish_reason)
        return finished

    def get_metrics(self):
        return self.metrics.snapshot(self.scheduler.make_stats())


__all__ = ["LLMEngine"]
