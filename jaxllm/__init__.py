"""jaxllm: a JAX/XLA reimplementation of vLLM's offline engine."""

from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in jax and the models; import it on first use so `import jaxllm` stays light.
    if name == "LLM":
        from jaxllm.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
