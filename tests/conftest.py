"""Shared pytest setup: run JAX on CPU unless told otherwise.

Set before anything imports jax: the platform is fixed at jax's first backend use, and a CUDA
plugin is installed on machines without a GPU. No x64: the model runs in f32/bf16 as served.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
