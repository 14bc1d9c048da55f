"""LoRA under tensor parallelism (2 host devices, one subprocess: tp_lora_facts.py).

The adapter's tables are split like the layers they adapt (jaxllm/lora/feature.py): B by
output columns for the column-parallel q/k/v/gate/up, A by input rows for the row-parallel
o/down, so a device holds only its slice. Greedy tokens with an adapter equal TP=1's, and the
optimized HLO of every compiled step holds exactly the base model's collectives (2 * layers
+ 1 all-reduces of [T, D], 2 logits all-gathers) plus, per row-parallel projection, one
all-reduce of its shrink: [T, R] where one adapter runs, [T, M * R] where several do (one
`lax.switch` branch each). Nothing shaped like a LoRA table is ever gathered.
"""

from __future__ import annotations

import ast
import json
import os

import pytest

from host_devices import run_on_host_devices

pytestmark = pytest.mark.slow
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    script = os.path.join(os.path.dirname(__file__), "tp_lora_facts.py")
    proc = run_on_host_devices([script, str(tmp_path_factory.mktemp("tp_lora"))], 2)
    return json.loads(next(line for line in proc.stdout.splitlines()
                           if line.startswith("{")))


def test_tokens_with_an_adapter_equal_tp1(facts):
    assert facts["tp2"]["tokens"] == facts["tp1"]["tokens"]


def test_each_device_holds_its_slice_of_the_tables(facts):
    tables = facts["tp2"]["tables"]
    assert sorted(tables) == sorted(f"{t}.{h}" for t in COLUMN_PARALLEL + ROW_PARALLEL
                                    for h in "AB")
    for name, (whole, shard) in tables.items():
        target, half = name.split(".")
        split_axis = {("A", True): 2, ("B", False): 3}.get((half, target in ROW_PARALLEL))
        want = [d // 2 if axis == split_axis else d for axis, d in enumerate(whole)]
        assert shard == want, name


def test_collectives_are_the_base_models_plus_one_shrink_reduce_per_row_parallel_layer(facts):
    c = facts["config"]
    L, D, R, M = c["layers"], c["hidden"], c["rank"], c["max_loras"]
    assert facts["tp2"]["steps"]
    for key, found in facts["tp2"]["steps"].items():
        T = ast.literal_eval(key)[0]  # (T, W); S == T here (max_num_seqs 4 >= T)
        assert {x["op"] for x in found} <= {"all-reduce", "all-gather"}, key
        gathers = sorted(x["shape"] for x in found if x["op"] == "all-gather")
        assert gathers == [[T, 512], [T, 512]], key  # sampled and prompt-logprob logits
        reduces = sorted(x["shape"] for x in found if x["op"] == "all-reduce")
        assert reduces == sorted([[T, D]] * (2 * L + 1) + [[T, R]] * (2 * L)
                                 + [[T, M * R]] * (2 * L)), key
