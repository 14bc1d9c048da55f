"""What an offline engine must hold once every request is over, for the tests that throw bad
input at it.

Owns: the one check that nothing was left behind (no unfinished request in the engine or its
output processor, every KV block but the null block free). Never sends requests.
"""

from __future__ import annotations


def assert_nothing_left(llm) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.has_unfinished()
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
