"""LLMEngine: the synchronous front end. add_request, then step() = core step + outputs.

Owns the wiring (model, tokenizer, KV cache size, processor, engine core, output processor)
and the request-id bookkeeping between them. Input checks live in `engine/processor.py`,
the step loop in `engine/core.py`, user-facing outputs in `engine/output_processor.py`. A
request that fails its checks raises ValueError before anything is added, so it never
disturbs requests already in flight; `add_requests` admits a whole batch or nothing.

A request that fails inside the engine (admitting it, or any part of a step) fails whole: all
its `n` samples end, their blocks are freed, and the other requests go on.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import jax

from jaxllm.cache import compilation_cache_dir, enable_compilation_cache
from jaxllm.config import EngineConfig
from jaxllm.distributed.launch import process_group
from jaxllm.engine.core import EngineCore, StepFailed
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.processor import FanOut, ProcessedRequest, Processor, PromptInput
from jaxllm.engine.request import RequestStatus
from jaxllm.engine.request_ids import RequestIds
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sleep import SleepMode
from jaxllm.engine.stat_logger import LoggingStatLogger
from jaxllm.engine.structured_output import StructuredOutputManager
from jaxllm.kernels.backends import select_backend
from jaxllm.kernels.linear_methods import select_linear_method
from jaxllm.lora.manager import make_lora_manager
from jaxllm.metrics import EngineMetrics, cache_config_info
from jaxllm.models.auto_dtype import (AutoDtypeVerdict, GemmShapes, auto_dtype_verdict,
                                      log_once, verdict_cache_path)
from jaxllm.models.checkpoint import (checkpoint_hf_config, load_for_engine,
                                      read_checkpoint_config)
from jaxllm.models.dtype import DTYPES, resolve_dtype
from jaxllm.models.saved_state import StateKey, read_key, save_state
from jaxllm.models.registry import kv_sliding_window
from jaxllm.models.resolve import DEFAULT_MODEL, resolve_model
from jaxllm.models.sharding import Placement, make_mesh
from jaxllm.outputs import RequestOutput
from jaxllm.research.requests import ResearchLimits
from jaxllm.runner.buckets import BucketConfig
from jaxllm.runner.features import make_step_features
from jaxllm.spec_decode.feature import spec_decode_features
from jaxllm.spec_decode.draft_model import draft_proposer
from jaxllm.spec_decode.scheduling import make_spec_scheduling
from jaxllm.runner.kv_cache import (DeviceMemory, KVCacheSizing, StepMemory,
                                    determine_num_blocks, device_memory, kv_bytes_per_block,
                                    needs_profile, provisional_num_blocks, size_from_profile)
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def _on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


def replica_devices(config: EngineConfig, data_parallel_rank: int) -> list:
    """The devices of one data-parallel replica: tensor_parallel_size of them, in order."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    if not 0 <= data_parallel_rank < dp:
        raise ValueError(f"data_parallel_rank must be in [0, {dp}), got {data_parallel_rank}")
    devices = jax.devices()
    if len(devices) < tp * dp:
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs "
                         f"{tp * dp} devices, but only {len(devices)} are available")
    return devices[data_parallel_rank * tp:(data_parallel_rank + 1) * tp]


def release_free_heap() -> None:
    """Hand memory that loading and compiling freed back to the OS: glibc keeps freed heap
    pages resident, and the KV cache and executables that come next are mapped afresh. A
    no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class LLMEngine:
    def __init__(self, config: EngineConfig, use_tqdm: bool = True, *,
                 request_ids: RequestIds | None = None, data_parallel_rank: int = 0,
                 read_device_memory: Callable[[Iterable], DeviceMemory | None] = device_memory):
        """request_ids: the ids in flight, shared with the front end that admits into this
        engine (AsyncLLM reserves them before its engine thread admits).
        data_parallel_rank: which replica this is (of config.data_parallel_size, AsyncLLM
        builds them): it runs on devices [rank * tp, (rank + 1) * tp).
        read_device_memory(devices): the accelerator memory the KV cache is sized from
        (runner/kv_cache.py); None on CPU. Tests pass a fake device's.
        With nnodes > 1 every process builds this engine from the same arguments; on
        node_rank > 0 the constructor then replays the leader's steps until the leader shuts
        down, and returns an engine that refuses requests (jaxllm/distributed/)."""
        # First: several processes need jax.distributed before anything starts jax.
        self.process_group = process_group(config)
        cache_dir = compilation_cache_dir(config.compilation_cache_dir)
        enable_compilation_cache(cache_dir)
        accel = _on_accelerator()
        resolved = resolve_model(config.model or DEFAULT_MODEL, gguf_file=config.gguf_file)
        saved = read_key(resolved.path) if resolved.kind == "saved_state" else None
        if saved is not None and config.dtype == "auto":  # a saved state's dtype is its own
            dtype, reader = DTYPES[saved.dtype], None
        else:
            dtype, reader = self._resolve_dtype(config, resolved, use_cache=cache_dir is not None)
        # Chosen before loading: a backend that cannot run here fails at once.
        backend = select_backend(config.attention_backend)
        linear_method = select_linear_method(
            config.linear_backend or (saved.linear_method if saved else None), dtype,
            tensor_parallel_size=config.tensor_parallel_size)
        t0 = time.perf_counter()
        placement = Placement(make_mesh(config.tensor_parallel_size,
                                        devices=replica_devices(config, data_parallel_rank)))
        loaded = load_for_engine(
            resolved, dtype, linear_method, placement=placement, tokenizer=config.tokenizer,
            use_cache=cache_dir is not None, reader=reader)
        model, mcfg, gen = loaded.model, loaded.model_config, loaded.generation_config
        self.tokenizer, self.generation_config = loaded.tokenizer, gen
        self.resolved_model, self.dtype = resolved, dtype
        logger.info("loaded %s from %s (%s) in %.1f s", resolved.name, resolved.path,
                    loaded.source, time.perf_counter() - t0)
        replication = placement.layout(mcfg).describe_replication()
        if replication:
            logger.warning(replication)
        release_free_heap()  # the host copies of the weights, before the KV cache arrives
        if config.max_model_len and config.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is greater than the model's maximum "
                f"length ({mcfg.max_position_embeddings}); choose max_model_len <= "
                f"{mcfg.max_position_embeddings}")
        self.config = config = config.resolved(mcfg.max_position_embeddings, accel)
        # A network that depends on the context length served (Phi-3's LongRoPE factors) is
        # told it before its step is compiled; optional, like a family's adapt_checkpoint.
        configure = getattr(model, "configure_max_model_len", None)
        if configure is not None:
            configure(config.max_model_len)
        self.model_config = mcfg
        eos = self.tokenizer.eos_token_id
        gen_eos = gen.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        # Extra EOS ids from generation_config act as stop tokens (as in vLLM).
        extra_eos_ids = [t for t in gen_eos if t != eos]
        self.processor = Processor(self.tokenizer, vocab_size=mcfg.vocab_size,
                                   max_model_len=config.max_model_len,
                                   max_logprobs=config.max_logprobs, eos_token_id=eos,
                                   extra_eos_ids=extra_eos_ids, engine_seed=config.seed,
                                   scheduling_policy=config.scheduling_policy,
                                   max_n_sequences=config.max_n_sequences,
                                   research=ResearchLimits(config.research,
                                                           num_layers=mcfg.num_hidden_layers,
                                                           hidden_size=mcfg.hidden_size,
                                                           num_heads=mcfg.num_attention_heads,
                                                           head_dim=mcfg.head_dim))

        # LoRA adapters (jaxllm/lora/manager.py): its step feature, or nothing when disabled.
        self.lora_manager = make_lora_manager(config, model, config.max_num_seqs, dtype,
                                              single_device=placement.mesh.size == 1)
        max_blocks = -(-config.max_model_len // config.block_size)
        # Every backend reads only each sequence's own pages, so one block-table width serves.
        # Speculation: a batch-1 verify step (1 + k rows) gets its own bucket.
        spec_k = (config.speculative_config.num_speculative_tokens
                  if config.speculative_config is not None else 0)
        buckets = BucketConfig.create(
            config.max_num_batched_tokens, config.max_num_seqs, max_blocks, bucket_widths=False,
            extra_tokens=(1 + spec_k,) if spec_k else ())
        # No KV cache yet (0 blocks): on an accelerator it is sized from a profile first.
        runner = ModelRunner(model, num_blocks=0, block_size=config.block_size,
                             kv_dtype=dtype, buckets=buckets, attention_backend=backend,
                             max_model_len=config.max_model_len,
                             max_num_seqs=config.max_num_seqs,
                             eos_token_ids=tuple(self.processor.eos_token_ids),
                             mesh=placement.mesh,
                             logprobs_mode=config.logprobs_mode,
                             max_logprobs=config.max_logprobs,
                             linear_method=linear_method,
                             features=make_step_features(config.research,
                                                         num_slots=config.max_num_seqs,
                                                         hidden_size=mcfg.hidden_size,
                                                         num_heads=mcfg.num_attention_heads,
                                                         head_dim=mcfg.head_dim,
                                                         vocab_size=mcfg.vocab_size,
                                                         num_speculative_tokens=spec_k)
                             + spec_decode_features(config.speculative_config,
                                                    config.max_num_seqs, mcfg.vocab_size,
                                                    config.max_logprobs)
                             + self.lora_manager.features)
        del model
        # The figures behind num_blocks on an accelerator (None where the config or the CPU
        # default decides). Each process reads its own devices.
        local = [d for d in placement.mesh.devices.flat if d.process_index == jax.process_index()]
        self.kv_sizing = sizing = self._profile(runner, read_device_memory(local), dtype)
        # The loaded model's config: its KV heads are the layout's (replicated when tp > K).
        # Every process must hold the same cache: the smallest that fits everywhere.
        num_blocks = self.process_group.agree_min(
            "num_blocks", determine_num_blocks(config, runner.model_config, dtype,
                                               tp=config.tensor_parallel_size, sizing=sizing))
        runner.initialize_kv_cache(num_blocks)
        kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.max_model_len,
                                          enable_caching=config.enable_prefix_caching,
                                          sliding_window=kv_sliding_window(mcfg))
        scheduler = Scheduler(kv_cache_manager, config.max_num_seqs,
                              config.max_num_batched_tokens, config.max_model_len,
                              policy=config.scheduling_policy,
                              structured_output_manager=StructuredOutputManager(
                                  config.structured_outputs_config, self.tokenizer,
                                  mcfg.vocab_size),
                              spec_decoding=make_spec_scheduling(
                                  config.speculative_config, kv_cache_manager,
                                  config.max_model_len, config.logprobs_mode,
                                  config.max_num_batched_tokens,
                                  draft_proposer(config, mcfg.vocab_size, dtype, num_blocks)),
                              max_loras=self.lora_manager.max_loras)
        self.model_runner = runner

        def reload_state():  # sleep level 2's wake_up: the same load as above
            from flax import nnx

            return nnx.split(load_for_engine(
                resolved, dtype, linear_method, placement=placement,
                tokenizer=config.tokenizer, use_cache=cache_dir is not None).model)[1]

        self.sleep_mode = SleepMode(self, reload_state)
        self.engine_core = EngineCore(scheduler, self.process_group.executor(runner),
                                      config.async_scheduling)
        self.metrics = EngineMetrics(resolved.name, engine_index=data_parallel_rank,
                                     max_model_len=config.max_model_len,
                                     cache_config_info=cache_config_info(config, num_blocks))
        self.request_ids = request_ids if request_ids is not None else RequestIds()
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics, self.request_ids)
        self._aborted_outputs: list[RequestOutput] = []
        # The periodic stats line; get_metrics() works either way.
        self.stat_logger = None if config.disable_log_stats else LoggingStatLogger()
        self.warmup_seconds = 0.0
        if not config.enforce_eager:
            t0 = time.perf_counter()
            runner.warmup(use_tqdm=use_tqdm)
            self.warmup_seconds = time.perf_counter() - t0
            if sizing is not None:
                sizing.check(runner.step_memory())
        elif sizing is not None:  # buckets compile while serving: check each as it comes
            runner.step_fns.on_compile = lambda key, fn: self.kv_sizing.warn_if_over(
                key, StepMemory.of(fn.memory_analysis(), runner.persistent_bytes()))
        release_free_heap()
        self.process_group.follow(runner)  # node_rank > 0: until the leader shuts down

    def _resolve_dtype(self, config: EngineConfig, resolved, use_cache: bool):
        """-> (jnp dtype, the GGUF parse made on the way or None). "auto" on a CPU is timed
        at the model's decode shapes (models/auto_dtype.py); the processes of a multi-process
        engine all run bfloat16 only if every one of them measured it faster."""
        reader = None

        def measure() -> AutoDtypeVerdict:
            nonlocal reader
            mcfg, reader = read_checkpoint_config(resolved, use_cache)
            verdict = auto_dtype_verdict(GemmShapes.of(mcfg),
                                         verdict_cache_path() if use_cache else None,
                                         config.linear_backend, config.tensor_parallel_size)
            if not self.process_group.agree_min("auto_dtype_bf16",
                                                int(verdict.dtype == "bfloat16")):
                verdict = dataclasses.replace(
                    verdict, dtype="float32",
                    source=verdict.source + "; another process measured float32 faster")
            log_once(verdict)
            return verdict

        return resolve_dtype(config.dtype, jax.default_backend(), measure), reader

    def _profile(self, runner: ModelRunner, memory: DeviceMemory | None,
                 dtype) -> KVCacheSizing | None:
        """On an accelerator, the KV cache's figures from the compiled largest bucket (one
        extra compile, also with enforce_eager); None where the config or the CPU default
        decides."""
        config = self.config
        if not needs_profile(config, memory):
            return None
        per_block = kv_bytes_per_block(runner.model_config, config.block_size, dtype,
                                       config.tensor_parallel_size)
        t0 = time.perf_counter()
        steps = runner.profile_run(provisional_num_blocks(config, memory, per_block))
        sizing = size_from_profile(config, memory, per_block, steps)
        logger.info("%s; profiled in %.1f s", sizing.describe(), time.perf_counter() - t0)
        return sizing

    def save_sharded_state(self, path: str) -> None:
        """Save the parameters as they are now (edits included), with the config and the
        tokenizer, to the new directory `path`, which `LLM(model=path)` then serves
        (models/saved_state.py): each device writes its own shard."""
        if jax.process_count() > 1:
            raise ValueError("save_sharded_state saves from a single-process engine; this one "
                             f"runs in {jax.process_count()} processes")
        runner = self.model_runner
        key = StateKey.of(self.dtype, self.config.tensor_parallel_size, runner.linear_method)
        save_state(path, runner.state, key,
                   checkpoint_hf_config(self.resolved_model, self.dtype),
                   self.generation_config, self.tokenizer)

    # The pieces, by their vLLM names.
    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.model_runner

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.engine_core.scheduler.kv_cache_manager

    # ---- admission ---------------------------------------------------------------------

    def add_request(self, prompt: str | None, prompt_token_ids: Sequence[int] | None,
                    params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Admit one request (text, token ids, or both); -> its request id."""
        return self.add_requests([PromptInput(prompt, None if prompt_token_ids is None
                                              else list(prompt_token_ids))], [params],
                                 [request_id], arrival_time, priorities=[priority])[0]

    def add_requests(self, prompts: Sequence[PromptInput], params: Sequence[SamplingParams],
                     request_ids: Sequence[str | None] | None = None,
                     arrival_time: float | None = None,
                     output_kind: RequestOutputKind | None = None,
                     priorities: Sequence[int] | None = None) -> list[str]:
        """Admit a batch, all or nothing: every prompt is tokenized and checked, and every
        id checked for collisions, before the first one is queued. output_kind overrides
        the params' (LLM.generate uses FINAL_ONLY); priorities: one per prompt (0)."""
        self.process_group.check_leader()  # before any id is taken
        request_ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        priorities = list(priorities) if priorities is not None else [0] * len(prompts)
        for sp in params:
            self.lora_manager.check(sp)  # a bad or disabled adapter: ValueError, nothing queued
        processed: list[ProcessedRequest] = [
            self.processor.process(p, sp, output_kind, priority)
            for p, sp, priority in zip(prompts, params, priorities, strict=True)]
        ids = self.request_ids.reserve([(rid, r.params.n)
                                        for r, rid in zip(processed, request_ids, strict=True)])
        fanned: list[FanOut] = [self.processor.fan_out(r, rid, arrival_time)
                                for r, rid in zip(processed, ids)]
        admitted: list[str] = []
        try:
            for request in fanned:
                self.admit(request)
                admitted.append(request.request_id)
        except BaseException:
            for request in fanned[len(admitted):]:
                self.request_ids.release(request.request_id)
            self.discard_requests(admitted)
            raise
        return ids

    def admit(self, request: FanOut) -> None:
        """Queue a request the processor has checked and fanned out (its ids reserved). All
        or nothing: if this raises, nothing of the request stays and its ids are free."""
        self.process_group.check_leader()
        added: list[str] = []
        try:
            self.output_processor.add_request(request, request.children[0].arrival_time)
            for child in request.children:
                self.engine_core.add_request(child)
                added.append(child.request_id)
        except BaseException:
            self.engine_core.finish_requests(added, RequestStatus.FINISHED_ERROR)
            self.output_processor.forget(request)
            self.request_ids.release(request.request_id)
            raise

    def abort_request(self, request_ids) -> None:
        """Abort requests by id (a parent id aborts all its `n` children). Their blocks are
        freed now; their final outputs (finish_reason "abort") come out of the next step()."""
        self._aborted_outputs += self.abort_now(request_ids)

    def discard_requests(self, request_ids) -> None:
        """Abort requests whose caller will never read them (no final outputs)."""
        self.abort_now(request_ids)

    def abort_now(self, request_ids) -> list[RequestOutput]:
        """Abort requests and return their final outputs (finish_reason "abort") at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids, finished = self.output_processor.abort_requests(ids)
        self.engine_core.abort_requests(child_ids)
        return finished

    # ---- the loop ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return (self.engine_core.has_unfinished_requests()
                or bool(self._aborted_outputs))

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs it emits (finished requests, and for CUMULATIVE / DELTA
        requests every one that advanced). A request that failed on its own in this step
        (its scheduling, update or output) ends with finish_reason "error" among them. If the
        model step itself raises, the requests it carried are finished with an error and
        StepFailed (listing them, with the original exception as its cause, and with every
        output this step owes in `request_outputs`) is raised; the engine keeps serving the
        rest."""
        finished, self._aborted_outputs = self._aborted_outputs, []
        try:
            engine_outputs = self.engine_core.step()
        except StepFailed as failure:
            children = self.output_processor.children
            failure.request_ids = sorted({children[c].parent.request_id
                                          for c in failure.req_ids if c in children})
            done, _ = self.output_processor.process_outputs(failure.outputs)
            failure.request_outputs = finished + done + self._end_failed_requests()
            raise
        so = self.scheduler.last_scheduler_output  # this step's schedule (one per step)
        if so is not None and so.total_num_scheduled_tokens:
            self.metrics.observe("jaxllm:iteration_tokens_total", so.total_num_scheduled_tokens)
        done, stopped = self.output_processor.process_outputs(engine_outputs)
        if stopped:
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        ended = self._end_failed_requests()
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(self.scheduler.make_stats)
        return finished + done + ended

    def _end_failed_requests(self) -> list[RequestOutput]:
        """A failed sample fails its whole request: finish in the engine core the samples
        whose output failed, and abort the failed requests' other samples (-> their final
        outputs)."""
        failures = self.output_processor.take_failures()
        self.engine_core.finish_requests(failures.child_ids, RequestStatus.FINISHED_ERROR)
        return self.abort_now(failures.parent_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name). Refused (False) while requests hold
        blocks."""
        return self.scheduler.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Release the device memory of the KV cache, and of the weights (kept on the host
        at level 1, dropped at level 2); refused while requests are unfinished."""
        self.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleep_mode.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_mode.is_sleeping

    def get_metrics(self):
        return (self.metrics.snapshot(self.scheduler.make_stats())
                + self.lora_manager.metrics(self.scheduler))

    def shutdown(self) -> None:
        """With several processes: tell the followers to stop (also done at exit). The
        engine takes no steps after this."""
        self.scheduler.spec_decoding.shutdown()
        self.process_group.shutdown()


__all__ = ["LLMEngine"]
