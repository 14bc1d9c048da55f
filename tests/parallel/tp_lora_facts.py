"""Run in a subprocess with 2 host devices: a tiny Llama with one random LoRA adapter (q_proj
and down_proj) at TP=1 and TP=2; print, as one JSON line, each run's greedy tokens, and for
TP=2 every LoRA table's global and per-device shape and the collectives of every compiled
step (test_tp_lora.py asserts on them).

    python tests/parallel/tp_lora_facts.py WORKDIR     (XLA_FLAGS sets the device count)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "engine_e2e"))

from lora_adapters import write_random_adapter  # noqa: E402
from tiny_model import SMALL, TINY_CONFIG, build_tiny_hf_dir, greedy  # noqa: E402

from jaxllm import LLM  # noqa: E402
from jaxllm.kernels import hlo_text  # noqa: E402
from jaxllm.lora.request import LoRARequest  # noqa: E402

PROMPTS = [{"prompt_token_ids": [1, 500, 60, 70]}, {"prompt_token_ids": [7, 8, 9]}]
ENGINE = dict(SMALL, enable_lora=True, max_loras=2, max_num_seqs=4, max_num_batched_tokens=4)


def run(model: str, adapter: str, tp: int) -> tuple[dict, LLM]:
    llm = LLM(model, tensor_parallel_size=tp, **ENGINE)
    lora = LoRARequest("a", 1, adapter)
    tokens = [o.outputs[0].token_ids
              for o in llm.generate(PROMPTS, greedy(6), lora_request=lora, use_tqdm=False)]
    return {"tokens": tokens}, llm


def main(work: str) -> None:
    model = os.path.join(work, "model")
    build_tiny_hf_dir(model, "LlamaConfig", "LlamaForCausalLM", vocab_size=512, **TINY_CONFIG)
    adapter = write_random_adapter(os.path.join(work, "adapter"), TINY_CONFIG, seed=1)
    facts = {"tp1": run(model, adapter, 1)[0]}
    tp2, llm = run(model, adapter, 2)
    runner = llm.llm_engine.model_runner
    lora = next(f for f in runner.features if f.name == "lora")
    tp2["tables"] = {
        f"{t}.{half}": [list(rows.device.shape),
                        list(rows.device.sharding.shard_shape(rows.device.shape))]
        for t, pair in lora.tables.items() for half, rows in zip("AB", pair)}
    tp2["steps"] = {str(key): [dataclasses.asdict(c)
                               for c in hlo_text.collectives(fn.as_text())]
                    for key, fn in runner.step_fns.items()}
    facts["tp2"] = tp2
    facts["config"] = {"layers": TINY_CONFIG["num_hidden_layers"], "rank": 16,
                       "max_loras": ENGINE["max_loras"], "hidden": TINY_CONFIG["hidden_size"]}
    print(json.dumps(facts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
