"""Every flag of `vllm serve` (vLLM 0.32), as data: what `jaxllm serve` does with each.

Owns the table below and its reading. One row per vLLM flag, under vLLM's argument group:

    option strings (comma-separated)   arity   class          why (for the user)

arity: `bool` (`--x`, `--x VALUE`, and `--no-x` where vLLM has it), `value`, `list` (one or
more values). class:
  impl        jaxllm implements it (the CLI's own flag of the same name, same meaning);
  noop        accepted and ignored, with one log line giving the why: it is about vLLM's
              process layout, a CUDA-only tuning, or a feature jaxllm has always on;
  only=V      accepted (a no-op, logged) when its value is V, which is vLLM's default; any
              other value is refused at start-up with the why. `only=` (nothing after the
              sign): any value given is refused.

Never decides anything by branching on a flag's name: the CLI (cli.py) builds the parser
from these rows and asks `apply` what to log and what to refuse.
"""

from __future__ import annotations

import dataclasses

_TABLE = """
[options]
--headless                                   bool  impl
--api-server-count,-asc                      value only=1        jaxllm runs one API server process
--config                                     value impl
--grpc                                       bool  only=false    jaxllm serves HTTP only
--disable-log-stats                          bool  impl
--aggregate-engine-logging                   bool  noop          jaxllm logs one stats line for all replicas
--fail-on-environ-validation,--no-fail-on-environ-validation bool  noop          jaxllm reads no VLLM_* environment
--shutdown-timeout                           value impl
--gdn-prefill-backend                        value noop          a CUDA kernel choice for model families jaxllm does not run
--kda-prefill-backend                        value noop          a CUDA kernel choice for model families jaxllm does not run
--kda-decode-backend                         value noop          a CUDA kernel choice for model families jaxllm does not run
--enable-log-requests,--no-enable-log-requests bool  noop          jaxllm does not log requests; errors are logged with their traceback
[Frontend]
--disable-frontend-multiprocessing,--no-disable-frontend-multiprocessing bool  noop          vLLM's process layout (earlier vLLM); jaxllm's server is one process
--lora-modules                               list  impl
--chat-template                              value impl
--chat-template-content-format               value only=auto     jaxllm passes message content as given to the template
--trust-request-chat-template,--no-trust-request-chat-template bool  impl
--trust-request-mm-kwargs,--no-trust-request-mm-kwargs bool  noop          jaxllm serves no multimodal models
--default-chat-template-kwargs               value only=         not supported: pass chat_template_kwargs per request
--response-role                              value only=assistant the chat response role is always assistant
--return-tokens-as-token-ids,--no-return-tokens-as-token-ids bool  impl
--enable-auto-tool-choice,--no-enable-auto-tool-choice bool  impl
--exclude-tools-when-tool-choice-none,--no-exclude-tools-when-tool-choice-none bool  only=false    not supported
--tool-call-parser                           value impl
--tool-parser-plugin                         value only=         tool parser plugins are not loaded (no outside code)
--tool-strict-level                          value only=auto     not supported
--tool-server                                value only=         the Responses API's tool servers are not supported
--max-log-len                                value noop          jaxllm does not log requests; errors are logged with their traceback
--enable-prompt-tokens-details,--no-enable-prompt-tokens-details bool  noop          usage.prompt_tokens_details is always returned
--enable-per-request-metrics,--no-enable-per-request-metrics bool  only=false    not supported
--enable-server-load-tracking,--no-enable-server-load-tracking bool  impl
--enable-force-include-usage,--no-enable-force-include-usage bool  only=false    not supported
--sse-keep-alive-interval                    value only=0        SSE keep-alive comments are not sent
--enable-tokenizer-info-endpoint,--no-enable-tokenizer-info-endpoint bool  impl
--enable-log-outputs,--no-enable-log-outputs bool  noop          jaxllm does not log requests; errors are logged with their traceback
--enable-log-deltas,--no-enable-log-deltas   bool  noop          jaxllm does not log requests; errors are logged with their traceback
--cohere-is-reasoning-model,--no-cohere-is-reasoning-model bool  noop          the Cohere and Anthropic APIs are not served
--cohere-format                              value noop          the Cohere and Anthropic APIs are not served
--anthropic-disabled-thinking-effort         value noop          the Cohere and Anthropic APIs are not served
--log-error-stack,--no-log-error-stack       bool  noop          jaxllm does not log requests; errors are logged with their traceback
--tokens-only,--no-tokens-only               bool  only=false    not supported
--enable-scale-out,--no-enable-scale-out     bool  only=false    elastic scale-out is not supported
--fingerprint-mode                           value noop          system_fingerprint is not set
--fingerprint-value                          value noop          system_fingerprint is not set
--host                                       value impl
--port                                       value impl
--grpc-port                                  value only=         jaxllm serves HTTP only
--data-parallel-supervisor-port              value noop          jaxllm's data-parallel replicas are threads of the one server process
--dp-supervisor-probe-interval-s             value noop          jaxllm's data-parallel replicas are threads of the one server process
--dp-supervisor-probe-timeout-s              value noop          jaxllm's data-parallel replicas are threads of the one server process
--dp-supervisor-probe-failure-threshold      value noop          jaxllm's data-parallel replicas are threads of the one server process
--uds                                        value impl
--uvicorn-log-level                          value impl
--disable-uvicorn-access-log,--no-disable-uvicorn-access-log bool  impl
--disable-access-log-for-endpoints           value noop          not supported: use --disable-uvicorn-access-log
--allow-credentials,--no-allow-credentials   bool  impl
--allowed-origins                            value impl
--allowed-methods                            value impl
--allowed-headers                            value impl
--api-key                                    list  impl
--ssl-keyfile                                value impl
--ssl-certfile                               value impl
--ssl-ca-certs                               value impl
--enable-ssl-refresh,--no-enable-ssl-refresh bool  only=false    not supported: restart to load new certificates
--ssl-cert-reqs                              value impl
--ssl-ciphers                                value impl
--root-path                                  value impl
--middleware                                 value only=         middleware from outside code is not loaded
--enable-request-id-headers,--no-enable-request-id-headers bool  impl
--disable-fastapi-docs,--no-disable-fastapi-docs bool  impl
--h11-max-incomplete-event-size              value impl
--h11-max-header-count                       value noop          uvicorn's h11 keeps its own header limit
--enable-offline-docs,--no-enable-offline-docs bool  noop          the docs pages are FastAPI's own
--enable-flash-late-interaction,--no-enable-flash-late-interaction bool  noop          late-interaction scoring is not implemented
[ModelConfig]
--model                                      value impl
--runner                                     value impl
--convert                                    value impl
--tokenizer                                  value impl
--tokenizer-mode                             value only=auto     jaxllm uses the model's Hugging Face tokenizer
--trust-remote-code,--no-trust-remote-code   bool  noop          jaxllm never runs a model repository's code
--dtype                                      value impl
--seed                                       value impl
--hf-config-path                             value only=         the config is read from the model directory
--allowed-local-media-path                   value noop          jaxllm serves no multimodal models
--allowed-media-domains                      list  noop          jaxllm serves no multimodal models
--revision                                   value noop          jaxllm reads local models only (no hub downloads)
--code-revision                              value noop          jaxllm reads local models only (no hub downloads)
--tokenizer-revision                         value noop          jaxllm reads local models only (no hub downloads)
--max-model-len                              value impl
--quantization,-q                            value only=gguf     jaxllm's quantized checkpoints are GGUF (pass the .gguf file)
--quantization-config                        value only=         not supported
--allow-deprecated-quantization,--no-allow-deprecated-quantization bool  only=false    not supported
--enforce-eager,--no-enforce-eager           bool  impl
--enable-return-routed-experts,--no-enable-return-routed-experts bool  only=false    not supported
--return-sampling-mask,--no-return-sampling-mask bool  only=false    not supported
--max-logprobs                               value impl
--logprobs-mode                              value impl
--use-fp64-gumbel,--no-use-fp64-gumbel       bool  only=false    not supported
--enable-trace-replay,--no-enable-trace-replay bool  only=false    not supported
--disable-sliding-window,--no-disable-sliding-window bool  only=false    not supported: sliding windows are honoured as the model says
--disable-cascade-attn,--no-disable-cascade-attn bool  noop          jaxllm has no cascade attention
--skip-tokenizer-init,--no-skip-tokenizer-init bool  only=false    jaxllm needs the tokenizer
--enable-prompt-embeds,--no-enable-prompt-embeds bool  impl
--served-model-name                          list  impl
--config-format                              value only=auto     the model directory's config.json (or the GGUF header) is read
--hf-token                                   value noop          jaxllm reads local models only (no hub downloads)
--hf-overrides                               value only=         not supported
--model-class-overrides                      value only=         not supported
--pooler-config                              value impl
--generation-config                          value only=auto     the model's generation_config.json is read
--override-generation-config                 value only=         not supported
--enable-sleep-mode,--no-enable-sleep-mode   bool  impl
--sleep-mode-offload-cudagraph,--no-sleep-mode-offload-cudagraph bool  noop          CUDA memory management; jaxllm frees its own device arrays
--sleep-preserve-parameter-names             list  only=         not supported: level 1 keeps all weights on the host
--enable-cumem-allocator,--no-enable-cumem-allocator bool  noop          CUDA memory management; jaxllm frees its own device arrays
--enable-nccl-comm-suspend,--no-enable-nccl-comm-suspend bool  noop          CUDA memory management; jaxllm frees its own device arrays
--model-impl                                 value only=auto     jaxllm runs its own model implementations
--logits-processors                          list  only=         code from outside is not loaded
--io-processor-plugin                        value only=         code from outside is not loaded
--renderer-num-workers                       value only=1        one input thread renders and tokenizes
[LoadConfig]
--load-format                                value only=auto     checkpoints are read by their file type
--download-dir                               value noop          jaxllm reads local models only (no hub downloads)
--safetensors-load-strategy                  value noop          jaxllm's loader reads safetensors its own way
--safetensors-prefetch-num-threads           value noop          jaxllm's loader reads safetensors its own way
--safetensors-prefetch-block-size            value noop          jaxllm's loader reads safetensors its own way
--model-loader-extra-config                  value only=         not supported
--ignore-patterns                            list  noop          jaxllm's loader reads safetensors its own way
--use-tqdm-on-load,--no-use-tqdm-on-load     bool  noop          jaxllm's loader reads safetensors its own way
--pt-load-map-location                       value noop          jaxllm's loader reads safetensors its own way
[AttentionConfig]
--attention-backend                          value impl
[MambaConfig]
--mamba-backend                              value noop          a CUDA kernel choice for model families jaxllm does not run
--mamba-ssu-algorithm                        value noop          a CUDA kernel choice for model families jaxllm does not run
--enable-mamba-cache-stochastic-rounding,--no-enable-mamba-cache-stochastic-rounding bool  noop          Mamba models are not served
--mamba-cache-philox-rounds                  value noop          Mamba models are not served
[StructuredOutputsConfig]
--reasoning-parser                           value only=         reasoning parsers are not supported yet
--reasoning-parser-plugin                    value only=         reasoning parsers are not supported yet
[ParallelConfig]
--distributed-executor-backend               value noop          vLLM's process layout; jaxllm's server is one process
--pipeline-parallel-size,-pp                 value only=1        only tensor and data parallelism are supported
--master-addr                                value impl
--master-port                                value impl
--nnodes,-n                                  value impl
--node-rank,-r                               value impl
--distributed-timeout-seconds                value noop          vLLM's process layout; jaxllm's server is one process
--cpu-distributed-timeout-seconds            value noop          vLLM's process layout; jaxllm's server is one process
--numa-bind,--no-numa-bind                   bool  noop          vLLM's process layout; jaxllm's server is one process
--numa-bind-nodes                            list  noop          vLLM's process layout; jaxllm's server is one process
--numa-bind-cpus                             list  noop          vLLM's process layout; jaxllm's server is one process
--device-ids                                 value noop          vLLM's process layout; jaxllm's server is one process
--tensor-parallel-size,-tp                   value impl
--decode-context-parallel-size,-dcp          value only=1        only tensor and data parallelism are supported
--dcp-comm-backend                           value noop          context parallelism is not supported
--dcp-q-replicate,--no-dcp-q-replicate       bool  noop          context parallelism is not supported
--dcp-kv-cache-interleave-size               value noop          context parallelism is not supported
--cp-kv-cache-interleave-size                value noop          context parallelism is not supported
--prefill-context-parallel-size,-pcp         value only=1        only tensor and data parallelism are supported
--data-parallel-size,-dp                     value impl
--data-parallel-rank,-dpn                    value only=         jaxllm's data-parallel replicas run inside one server process
--data-parallel-start-rank,-dpr              value only=         jaxllm's data-parallel replicas run inside one server process
--data-parallel-size-local,-dpl              value only=         jaxllm's data-parallel replicas run inside one server process
--data-parallel-address,-dpa                 value only=         jaxllm's data-parallel replicas run inside one server process
--data-parallel-rpc-port,-dpp                value only=         jaxllm's data-parallel replicas run inside one server process
--data-parallel-backend,-dpb                 value only=mp       jaxllm's data-parallel replicas run inside one server process
--data-parallel-hybrid-lb,--no-data-parallel-hybrid-lb,-dph bool  only=false    jaxllm balances its replicas itself
--data-parallel-external-lb,--no-data-parallel-external-lb,-dpe bool  only=false    jaxllm balances its replicas itself
--data-parallel-multi-port-external-lb,-dpm  bool  only=false    jaxllm balances its replicas itself
--enable-hc-sp,--no-enable-hc-sp             bool  only=false    not supported
--enable-expert-parallel,--no-enable-expert-parallel,-ep bool  only=false    not supported
--enable-batch-sharded-sampling,--no-enable-batch-sharded-sampling bool  only=false    not supported
--enable-ep-weight-filter,--no-enable-ep-weight-filter bool  only=false    not supported
--all2all-backend                            value noop          expert and micro-batch parallelism are not supported
--enable-dbo,--no-enable-dbo                 bool  only=false    not supported
--enable-shm-tensor-arena,--no-enable-shm-tensor-arena bool  noop          expert and micro-batch parallelism are not supported
--ubatch-size                                value noop          expert and micro-batch parallelism are not supported
--enable-elastic-ep,--no-enable-elastic-ep   bool  only=false    not supported
--elastic-ep-max-dp-size                     value noop          expert and micro-batch parallelism are not supported
--dbo-decode-token-threshold                 value noop          expert and micro-batch parallelism are not supported
--dp-sync-interval                           value noop          expert and micro-batch parallelism are not supported
--dbo-prefill-token-threshold                value noop          expert and micro-batch parallelism are not supported
--disable-nccl-for-dp-synchronization,--no-disable-nccl-for-dp-synchronization bool  noop          expert and micro-batch parallelism are not supported
--enable-eplb,--no-enable-eplb               bool  only=false    not supported
--eplb-config                                value noop          expert and micro-batch parallelism are not supported
--expert-placement-strategy                  value noop          expert and micro-batch parallelism are not supported
--max-parallel-loading-workers               value noop          vLLM's process layout; jaxllm's server is one process
--ray-workers-use-nsight,--no-ray-workers-use-nsight bool  noop          vLLM's process layout; jaxllm's server is one process
--disable-custom-all-reduce,--no-disable-custom-all-reduce bool  noop          vLLM's process layout; jaxllm's server is one process
--worker-cls                                 value noop          vLLM's process layout; jaxllm's server is one process
--worker-extension-cls                       value noop          vLLM's process layout; jaxllm's server is one process
--enable-fault-tolerance,--no-enable-fault-tolerance bool  only=false    not supported
--fault-tolerance-config                     value noop          not supported
[CacheConfig]
--block-size                                 value impl
--gpu-memory-utilization,--device-memory-utilization value impl
--kv-cache-memory-bytes                      value impl
--kv-cache-dtype                             value only=auto     the KV cache holds the model dtype
--num-gpu-blocks-override                    value impl
--enable-prefix-caching,--no-enable-prefix-caching bool  impl
--prefix-caching-hash-algo                   value noop          jaxllm's block hash is its own (sha256 over the token ids)
--prefix-cache-retention-interval            value noop          not supported
--kv-cache-dtype-skip-layers                 list  noop          not supported
--kv-sharing-fast-prefill,--no-kv-sharing-fast-prefill bool  noop          not supported
--swa-bounded-replay,--no-swa-bounded-replay bool  noop          not supported
--mamba-cache-dtype                          value noop          Mamba models are not served
--mamba-ssm-cache-dtype                      value noop          Mamba models are not served
--mamba-block-size                           value noop          Mamba models are not served
--prefix-match-unit                          value noop          not supported
--mamba-cache-mode                           value noop          Mamba models are not served
--enable-mamba-shared-prefix-checkpoint,--no-enable-mamba-shared-prefix-checkpoint bool  noop          Mamba models are not served
--replayssm-buffer-len                       value noop          Mamba models are not served
--use-replayssm,--no-use-replayssm           bool  noop          Mamba models are not served
--kv-offloading-size                         value only=         KV offloading is not supported
--kv-offloading-backend                      value noop          KV offloading is not supported
[OffloadConfig]
--offload-backend                            value noop          weight offloading is not supported
--cpu-offload-gb                             value only=0        weight offloading is not supported
--cpu-offload-params                         list  only=         weight offloading is not supported
--offload-group-size                         value only=0        weight offloading is not supported
--offload-num-in-group                       value noop          weight offloading is not supported
--offload-prefetch-step                      value noop          weight offloading is not supported
--offload-params                             list  only=         weight offloading is not supported
[MultiModalConfig]
--language-model-only,--no-language-model-only bool  noop          jaxllm serves language models only
--limit-mm-per-prompt                        value noop          jaxllm serves no multimodal models
--enable-mm-embeds,--no-enable-mm-embeds     bool  only=false    jaxllm serves no multimodal models
--media-io-kwargs                            value noop          jaxllm serves no multimodal models
--mm-processor-kwargs                        value noop          jaxllm serves no multimodal models
--mm-processor-cache-gb                      value noop          jaxllm serves no multimodal models
--mm-processor-cache-type                    value noop          jaxllm serves no multimodal models
--mm-hasher-algorithm                        value noop          jaxllm serves no multimodal models
--mm-shm-cache-max-object-size-mb            value noop          jaxllm serves no multimodal models
--mm-encoder-only,--no-mm-encoder-only       bool  only=false    jaxllm serves no multimodal models
--mm-encoder-tp-mode                         value noop          jaxllm serves no multimodal models
--mm-encoder-attn-backend                    value noop          jaxllm serves no multimodal models
--mm-encoder-attn-dtype                      value noop          jaxllm serves no multimodal models
--mm-encoder-fp8-scale-path                  value noop          jaxllm serves no multimodal models
--mm-encoder-fp8-scale-save-path             value noop          jaxllm serves no multimodal models
--mm-encoder-fp8-scale-save-margin           value noop          jaxllm serves no multimodal models
--interleave-mm-strings,--no-interleave-mm-strings bool  noop          jaxllm serves no multimodal models
--skip-mm-profiling,--no-skip-mm-profiling   bool  noop          jaxllm serves no multimodal models
--video-pruning-rate                         value noop          jaxllm serves no multimodal models
--video-pruning-method                       value noop          jaxllm serves no multimodal models
--mm-tensor-ipc                              value noop          jaxllm serves no multimodal models
--mm-processor-device                        value noop          jaxllm serves no multimodal models
--mm-ipc-gpu-memory-gb                       value noop          jaxllm serves no multimodal models
--mm-device-do-normalize,--no-mm-device-do-normalize bool  noop          jaxllm serves no multimodal models
[LoRAConfig]
--enable-lora,--no-enable-lora               bool  impl
--max-loras                                  value impl
--max-lora-rank                              value impl
--lora-dtype                                 value impl
--enable-tower-connector-lora,--no-enable-tower-connector-lora bool  noop          not supported (jaxllm's LoRA covers dense q/k/v/o/gate/up/down)
--max-cpu-loras                              value impl
--fully-sharded-loras,--no-fully-sharded-loras bool  noop          not supported (jaxllm's LoRA covers dense q/k/v/o/gate/up/down)
--lora-target-modules                        list  only=         not supported: an adapter applies to every module it targets
--default-mm-loras                           value noop          not supported (jaxllm's LoRA covers dense q/k/v/o/gate/up/down)
--specialize-active-lora,--no-specialize-active-lora bool  noop          not supported (jaxllm's LoRA covers dense q/k/v/o/gate/up/down)
--enable-mixed-moe-lora-format,--no-enable-mixed-moe-lora-format bool  noop          not supported (jaxllm's LoRA covers dense q/k/v/o/gate/up/down)
--enable-moe-shared-loras,--no-enable-moe-shared-loras bool  noop          not supported (jaxllm's LoRA covers dense q/k/v/o/gate/up/down)
--max-lora-cls-labels                        value noop          not supported (jaxllm's LoRA covers dense q/k/v/o/gate/up/down)
[LoggingConfig]
--logging-config                             value only=         configure the 'jaxllm' logger in Python
--log-level                                  value noop          jaxllm logs at INFO; see --uvicorn-log-level
--log-config-file                            value only=         configure the 'jaxllm' logger in Python
[ObservabilityConfig]
--show-hidden-metrics-for-version            value noop          jaxllm hides no deprecated metrics
--otlp-traces-endpoint                       value only=         OpenTelemetry tracing is not supported
--collect-detailed-traces                    list  only=         OpenTelemetry tracing is not supported
--per-request-spec-decode-metrics            value noop          speculative decoding is not supported
--kv-cache-metrics,--no-kv-cache-metrics     bool  noop          not supported
--kv-cache-metrics-sample                    value noop          not supported
--custom-histogram-buckets                   value noop          not supported
--cudagraph-metrics,--no-cudagraph-metrics   bool  noop          not supported
--enable-layerwise-nvtx-tracing,--no-enable-layerwise-nvtx-tracing bool  noop          not supported
--enable-mfu-metrics,--no-enable-mfu-metrics bool  noop          not supported
--enable-logging-iteration-details,--no-enable-logging-iteration-details bool  noop          not supported
--jit-monitor-mode                           value noop          not supported
--jit-monitor-verbose,--no-jit-monitor-verbose bool  noop          not supported
[SchedulerConfig]
--max-num-batched-tokens                     value impl
--max-num-scheduled-tokens                   value only=         not supported
--max-num-seqs                               value impl
--max-num-active-seqs                        value only=         not supported
--max-num-queued-reqs                        value only=         not supported
--max-num-queued-tokens                      value only=         not supported
--long-prefill-token-threshold               value only=         not supported
--long-prefill-token-threshold-adaptive,--no-long-prefill-token-threshold-adaptive bool  only=false    not supported
--scheduling-policy                          value impl
--enable-chunked-prefill,--no-enable-chunked-prefill bool  only=true     prefill is always chunked (one token budget per step)
--disable-chunked-mm-input,--no-disable-chunked-mm-input bool  noop          jaxllm serves no multimodal models
--scheduler-cls                              value only=         code from outside is not loaded
--scheduler-reserve-full-isl,--no-scheduler-reserve-full-isl bool  noop          jaxllm's scheduler has no such setting
--watermark                                  value noop          jaxllm's scheduler has no such setting
--prefill-schedule-interval                  value noop          jaxllm's scheduler has no such setting
--disable-hybrid-kv-cache-manager,--no-disable-hybrid-kv-cache-manager bool  noop          jaxllm's scheduler has no such setting
--async-scheduling,--no-async-scheduling     bool  impl
--stream-interval                            value only=1        every step's tokens are streamed
[CompilationConfig]
--cudagraph-capture-sizes                    list  noop          CUDA graphs: jaxllm compiles its own buckets
--max-cudagraph-capture-size                 value noop          CUDA graphs: jaxllm compiles its own buckets
[KernelConfig]
--ir-op-priority                             value noop          a CUDA kernel choice
--enable-flashinfer-autotune,--no-enable-flashinfer-autotune bool  noop          a CUDA kernel choice
--moe-backend                                value noop          a CUDA kernel choice
--linear-backend                             value impl
--sparse-indexer-topk-backend                value noop          a CUDA kernel choice
[VllmConfig]
--speculative-config,-sc                     value impl
--spec-method                                value only=         speculative decoding is not supported yet
--spec-model                                 value only=         speculative decoding is not supported yet
--spec-tokens                                value only=         speculative decoding is not supported yet
--watermark-config                           value only=         not supported
--diffusion-config,-dc                       value only=         not supported
--kv-transfer-config                         value only=         not supported
--kv-events-config                           value only=         not supported
--ec-transfer-config                         value only=         not supported
--ec-manager-config                          value noop          vLLM's own tuning; jaxllm compiles its own buckets
--compilation-config,-cc                     value noop          vLLM's own tuning; jaxllm compiles its own buckets
--attention-config,-ac                       value noop          vLLM's own tuning; jaxllm compiles its own buckets
--engram-config                              value only=         not supported
--reasoning-config                           value only=         not supported
--kernel-config                              value noop          vLLM's own tuning; jaxllm compiles its own buckets
--additional-config                          value noop          vLLM's own tuning; jaxllm compiles its own buckets
--structured-outputs-config                  value impl
--aux-output-config                          value noop          vLLM's own tuning; jaxllm compiles its own buckets
--profiler-config                            value noop          vLLM's own tuning; jaxllm compiles its own buckets
--optimization-level                         value noop          vLLM's own tuning; jaxllm compiles its own buckets
--performance-mode                           value noop          vLLM's own tuning; jaxllm compiles its own buckets
--weight-transfer-config                     value only=         not supported
"""


@dataclasses.dataclass(frozen=True)
class VllmFlag:
    group: str  # vLLM's argument group
    option_strings: tuple[str, ...]
    arity: str  # "bool", "value" or "list"
    kind: str  # "impl", "noop" or "only"
    accepted: str | None  # for "only": the one value accepted ("" accepts none)
    why: str

    @property
    def dest(self) -> str:
        return self.option_strings[0][2:].replace("-", "_")

    @property
    def help(self) -> str:
        if self.kind == "noop":
            return f"accepted, no effect: {self.why}"
        if self.accepted == "":
            return f"refused: {self.why}"
        return f"only {self.accepted} (no effect); other values refused: {self.why}"


def _read_table() -> list[VllmFlag]:
    flags, group = [], ""
    for line in _TABLE.strip().splitlines():
        if line.startswith("["):
            group = line.strip("[]")
            continue
        names, arity, kind, *why = line.split(None, 3)
        kind, _, accepted = kind.partition("=")
        flags.append(VllmFlag(group, tuple(names.split(",")), arity, kind,
                              accepted if kind == "only" else None, why[0] if why else ""))
    return flags


VLLM_FLAGS: list[VllmFlag] = _read_table()
GROUPS: list[str] = list(dict.fromkeys(f.group for f in VLLM_FLAGS))


def _as_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(_as_text(v) for v in value)
    return str(value)


def apply(values: dict) -> list[str]:
    """Take every vLLM-only flag out of `values` (parsed flags or config-file keys, by
    dest): -> the log lines for those accepted without effect. A refused one raises
    SystemExit naming the flag, its value and why."""
    notes = []
    for flag in VLLM_FLAGS:
        if flag.kind == "impl" or flag.dest not in values:
            continue
        value = values.pop(flag.dest)
        text = _as_text(value)
        name = flag.option_strings[0]
        if flag.kind == "only" and text.lower() != flag.accepted:
            allowed = f" (only {flag.accepted} is accepted)" if flag.accepted else ""
            raise SystemExit(f"jaxllm serve: {name} {text}: {flag.why}{allowed}")
        notes.append(f"{name} {text}: accepted, no effect ({flag.why})")
    return notes


__all__ = ["GROUPS", "VLLM_FLAGS", "VllmFlag", "apply"]
