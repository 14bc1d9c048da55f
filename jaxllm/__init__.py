"""jaxllm: a JAX/XLA reimplementation of vLLM: `LLM` offline, `AsyncLLM` and `jaxllm serve`."""

from jaxllm.platform import set_default_platform

set_default_platform()  # before anything imports jax: CPU on a machine with no NVIDIA GPU

from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from jaxllm.sampling_params import (RequestOutputKind, SamplingParams,  # noqa: E402
                                    StructuredOutputsParams)

# These pull in jax and the models: import them on first use so `import jaxllm` stays light.
_LAZY = {
    "LLM": ("jaxllm.llm", "LLM"),
    "AsyncLLM": ("jaxllm.async_llm", "AsyncLLM"),
    "AsyncLLMEngine": ("jaxllm.async_llm", "AsyncLLMEngine"),
    "AsyncEngineArgs": ("jaxllm.async_llm", "AsyncEngineArgs"),
    "BeamSearchParams": ("jaxllm.beam_search", "BeamSearchParams"),
    # Pooling models (jaxllm/pooling/).
    "PoolingParams": ("jaxllm.pooling.params", "PoolingParams"),
    **{name: ("jaxllm.pooling.outputs", name) for name in (
        "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
        "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
        "ScoringRequestOutput")},
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(name)


__all__ = ["LLM", "AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "SamplingParams",
           "StructuredOutputsParams", "BeamSearchParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob",
           "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
           "ScoringOutput", "ScoringRequestOutput"]
__version__ = "0.1.0"
