"""Host-side engine: requests, KV block ownership, and the token-budget scheduler.

Pure Python on purpose: nothing under jaxllm/engine imports jax, so scheduling can be tested
exactly and fast on any machine.
"""
