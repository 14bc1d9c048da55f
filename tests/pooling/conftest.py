"""The pooling tests' one all-MiniLM-L6-v2 engine (the packaged default), shared by the
offline and the server tests: five token buckets, 16..256, compiled once; at 256 rows the
attention runs in blocks of 64, four to a step (pooling/attention.py)."""

import pytest


@pytest.fixture(scope="package")
def minilm():
    from jaxllm import LLM

    return LLM(runner="pooling", max_model_len=64, max_num_batched_tokens=256)
