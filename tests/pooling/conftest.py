"""The pooling tests' all-MiniLM-L6-v2 engines (the packaged default), shared by the offline
and the server tests: `minilm` pools "embed", with five token buckets, 16..256, compiled once
(at 256 rows the attention runs in blocks of 64, four to a step: pooling/attention.py);
`minilm_tokens` pools "token_embed" (pooler_config), compiling only the buckets it uses."""

import pytest


@pytest.fixture(scope="package")
def minilm():
    from jaxllm import LLM

    return LLM(runner="pooling", max_model_len=64, max_num_batched_tokens=256)


@pytest.fixture(scope="package")
def minilm_tokens():
    from jaxllm import LLM

    return LLM(runner="pooling", max_model_len=64, max_num_batched_tokens=256,
               enforce_eager=True, pooler_config={"task": "token_embed"})
