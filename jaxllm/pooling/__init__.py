"""Pooling models (embed, classify, score): a runner beside the generative one.

config.py (which model, how it pools) -> engine.py (PoolingEngine: load, tokenize, step loop)
-> scheduler.py (the token budget) -> runner.py (packed steps, no KV cache) with
attention.py (masked dense attention) and poolers.py; offline.py is what `LLM.embed`,
`classify`, `score` and `encode` run. Never imported by the generative engine or runner.
"""
