"""jaxllm: a JAX/XLA reimplementation of vLLM's offline engine."""

from jaxllm.platform import set_default_platform

set_default_platform()  # before anything imports jax: CPU on a machine with no NVIDIA GPU

from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from jaxllm.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name):
    # LLM pulls in jax and the models; import it on first use so `import jaxllm` stays light.
    if name == "LLM":
        from jaxllm.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
