"""The platform the tests run on: JAXLLM_TEST_PLATFORM, "cpu" (default) or "gpu".

Owns the one reading of the variable, for tests/conftest.py (which sets JAX_PLATFORMS from it
before jax starts) and for the tests whose backend follows it (the Pallas kernel runs
compiled on a GPU, interpreted on the CPU). Never imports jax.
"""

from __future__ import annotations

import os

TEST_PLATFORMS = ("cpu", "gpu")

TEST_PLATFORM = os.environ.get("JAXLLM_TEST_PLATFORM", "cpu")
if TEST_PLATFORM not in TEST_PLATFORMS:
    raise ValueError(f"JAXLLM_TEST_PLATFORM must be one of {TEST_PLATFORMS}, got "
                     f"{TEST_PLATFORM!r}")

ON_GPU = TEST_PLATFORM == "gpu"
