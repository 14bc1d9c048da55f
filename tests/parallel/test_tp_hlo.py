"""Tensor parallelism, proven in the optimized HLO of the runner's step (host CPU devices).

For every attention backend at TP=2 and TP=4, and for the real SmolLM2-135M configuration at
TP=3 (30 layers; 49152 x 576 tied embedding), the per-device program holds exactly:
  * 2 * layers + 1 all-reduces, each of one activation [T, D]: the two of the Megatron
    layout per layer (after attention, after the MLP) and one for the vocabulary-parallel
    embedding lookup;
  * 2 all-gathers, each of logits: [S, V] for sampling, and [T, V] inside the
    prompt-logprobs branch (which runs only when a request asks);
  * no other collective, nothing shaped like a weight or a KV cache, and (for the backends
    that run on CPU for real) no whole-cache copy;
and each device holds only its KV heads: per-device KV bytes = total / tp, where the total
counts KV heads replicated the minimal way when tp exceeds them (2 KV heads at TP=4: 4).
"""

from __future__ import annotations

import json
import os

import pytest

from jaxllm.models.gguf import gguf_to_hf_config, open_gguf
from jaxllm.models.resolve import embedded_default_gguf

from host_devices import run_on_host_devices

pytestmark = pytest.mark.slow

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=1001, hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64)  # vocab 1001: padded to a multiple of tp


def _case(backend, tp, config=TINY, dtype="float32", T=32, S=8, W=16):
    return dict(name=f"{backend}-tp{tp}-{config['num_hidden_layers']}L", backend=backend,
                tp=tp, T=T, S=S, W=W, num_blocks=64, dtype=dtype, config=config)


def _cases():
    cases = [_case(b, tp) for b in ("xla", "cpu", "pallas_interpret") for tp in (2, 4)]
    smollm2 = gguf_to_hf_config(open_gguf(embedded_default_gguf()))
    cases.append(_case("cpu", 3, smollm2, dtype="bfloat16", T=64, S=64, W=128))
    return cases


CASES = _cases()
# KV heads of the model each case lays out (the checkpoint's, or replicated when tp > K).
EXPECTED_KV_HEADS = {"xla-tp2-2L": 2, "xla-tp4-2L": 4, "cpu-tp2-2L": 2, "cpu-tp4-2L": 4,
                     "pallas_interpret-tp2-2L": 2, "pallas_interpret-tp4-2L": 4,
                     "cpu-tp3-30L": 3}


@pytest.fixture(scope="module")
def facts():
    proc = run_on_host_devices([os.path.join(os.path.dirname(__file__), "tp_facts.py"),
                                json.dumps(CASES)], 4)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {f["case"]: f for f in lines}


def _by_op(f, op):
    return [c for c in f["collectives"] if c["op"] == op]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_collectives_are_activation_reduces_and_logit_gathers(facts, case):
    f = facts[case["name"]]
    cfg = case["config"]
    T, S, D, V = case["T"], case["S"], cfg["hidden_size"], f["padded_vocab"]
    reduces, gathers = _by_op(f, "all-reduce"), _by_op(f, "all-gather")
    assert [c for c in f["collectives"] if c["op"] not in ("all-reduce", "all-gather")] == []
    assert [(c["shape"], c["in_entry"]) for c in reduces] == \
        [([T, D], True)] * (2 * cfg["num_hidden_layers"] + 1)
    assert sorted((c["shape"], c["in_entry"]) for c in gathers) == \
        sorted([([S, V], True), ([T, V], False)])
    whole = [s for s in f["weight_shapes"] if len(s) == 2] + [f["cache_global"]]
    assert [c for c in f["collectives"] if c["shape"] in whole] == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_each_device_holds_its_kv_heads_only(facts, case):
    f = facts[case["name"]]
    tp, cfg = case["tp"], case["config"]
    kv_heads = EXPECTED_KV_HEADS[case["name"]]
    assert f["kv_heads"] == kv_heads
    assert f["cache_global"][2] == kv_heads and f["cache_local"][2] == kv_heads // tp
    itemsize = 2 if case["dtype"] == "bfloat16" else 4
    total = (2 * cfg["num_hidden_layers"] * case["num_blocks"] * 16 * kv_heads
             * cfg["head_dim"] * itemsize)
    assert f["kv_bytes_per_device"] * tp == total
    # Donated (updated in place): this device's caches and the token history, nothing else.
    assert f["donated_bytes"] == f["kv_bytes_per_device"] + f["history_bytes"]


# The Pallas interpreter runs the kernel on CPU over buffers of its own, copying a cache of
# one KV head per device (TP=2/4 here) as it goes: an emulation artifact. The real kernel's
# program is checked for copies where it runs, compiled for an 8-GPU node
# (test_tp_gpu_compile.py).
@pytest.mark.parametrize("case", [c for c in CASES if c["backend"] != "pallas_interpret"],
                         ids=lambda c: c["name"])
def test_no_whole_cache_copy(facts, case):
    assert facts[case["name"]]["cache_copies"] == []


def test_smollm2_embedding_is_split_not_gathered(facts):
    f = facts["cpu-tp3-30L"]
    assert f["padded_vocab"] == 49152
    assert [49152, 576] in f["weight_shapes"]  # the tied embedding / LM head, split 3 ways
    assert all(c["shape"] != [49152, 576] for c in f["collectives"])
