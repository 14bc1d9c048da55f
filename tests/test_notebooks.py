"""Every notebook in notebooks/ runs top to bottom in a real Jupyter kernel (nbclient, as a
researcher runs it), its cells' own `assert`s hold, it draws its plots, and the values it
reports at the end are the ones checked here, so the research entry points cannot silently
rot. Each notebook's last code cell prints one JSON line of the figures it computed."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def execute(path: pathlib.Path):
    """Run the notebook in a fresh python3 kernel started from notebooks/, seeing this
    checkout's jaxllm (not whatever an editable install points at). A failing cell (one of
    its asserts included) raises CellExecutionError with the cell and its traceback."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    # The inline backend draws into the cell outputs: no display needed.
    env.pop("MPLBACKEND", None)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env)
    return nb


def code_outputs(nb) -> list[list[dict]]:
    return [cell.outputs for cell in nb.cells if cell.cell_type == "code"]


def printed(outputs: list[dict]) -> str:
    return "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")


def summary(nb) -> dict:
    """The JSON line the last code cell printed."""
    return json.loads(printed(code_outputs(nb)[-1]).strip().splitlines()[-1])


def num_images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for outputs in code_outputs(nb)
               for o in outputs)


def test_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} == {"quickstart.ipynb",
                                           "inside_the_paged_kv_cache.ipynb",
                                           "throughput.ipynb",
                                           "logit_lens_and_attention.ipynb",
                                           "steering.ipynb"}


def test_notebooks_are_committed_without_outputs():
    import nbformat

    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert all(not c.outputs and c.execution_count is None
                   for c in nb.cells if c.cell_type == "code"), path.name


@pytest.mark.slow
def test_quickstart():
    nb = execute(ROOT / "notebooks" / "quickstart.ipynb")
    result = summary(nb)
    assert "Paris" in result["answer"]  # the greedy answer of the first prompt
    assert result["finish_reasons"] == ["length", "length"]
    assert result["num_generation_tokens"] == 2 * 24 + result["chat_tokens"]
    assert num_images(nb) == 1


@pytest.mark.slow
def test_inside_the_paged_kv_cache():
    nb = execute(ROOT / "notebooks" / "inside_the_paged_kv_cache.ipynb")
    result = summary(nb)
    # The three questions share the full blocks of the system prompt, held once by each.
    assert result["shared_by_questions"] >= 2
    assert result["question_ref_cnt"] == [3] * result["shared_by_questions"]
    # Six requests of 64 tokens each in a 16-block cache: preempted from the tail (the
    # youngest first; the oldest three run through), resumed by recompute; every token
    # decoded once, except each request's last.
    assert result["preemption_order"] == [5, 4, 3]
    assert result["num_preemptions"] == 3
    assert result["recompute_tokens"] > 0
    assert result["generation_tokens"] == 6 * 64
    assert result["decode_tokens"] == 6 * 63
    assert result["max_tokens_per_step"] <= 64
    assert num_images(nb) == 2


@pytest.mark.slow
def test_throughput():
    nb = execute(ROOT / "notebooks" / "throughput.ipynb")
    result = summary(nb)
    by_batch, by_context = result["by_batch"], result["by_context"]
    assert [(r["batch"], r["context"]) for r in by_batch] == [(b, 64) for b in (1, 2, 4, 8, 16)]
    assert [(r["batch"], r["context"]) for r in by_context] == [(4, c) for c in (64, 192, 448)]
    rows = by_batch + by_context
    assert result["bandwidth_gbs"] > 0 and result["peak_gflops"] > 0
    # Every step reads the same weights; KV grows with batch and context, FLOPs with batch.
    assert len({r["weight_mib"] for r in rows}) == 1
    for sweep in (by_batch, by_context):
        kv = [r["kv_mib"] for r in sweep]
        assert kv == sorted(set(kv)), kv
    assert [r["gflop"] for r in by_batch] == sorted({r["gflop"] for r in by_batch})
    # The roofline bounds what was measured (the margin is for noise).
    for r in rows:
        assert 0 < r["tokens_per_s"] < 1.5 * r["roofline_tokens_per_s"], r
    # Batching amortizes the weight reads (loosely: the machine may be shared).
    assert by_batch[-1]["roofline_tokens_per_s"] > 4 * by_batch[0]["roofline_tokens_per_s"]
    assert by_batch[-1]["tokens_per_s"] > 1.5 * by_batch[0]["tokens_per_s"]
    assert num_images(nb) == 1


@pytest.mark.slow
def test_logit_lens_and_attention():
    nb = execute(ROOT / "notebooks" / "logit_lens_and_attention.ipynb")
    result = summary(nb)
    assert result["answer"] == " Paris"
    probs = result["answer_prob"]
    assert len(probs) == 30
    # The answer is nowhere in the early layers and the model's choice at the last one.
    assert max(probs[:10]) < 1e-3 and probs[-1] > 0.5
    assert 0 < result["first_layer"] <= 29
    assert result["heads"] == 9 and result["num_positions"] == 5
    assert 0 <= result["attention_to_first"] <= 1
    assert num_images(nb) == 2


@pytest.mark.slow
def test_steering():
    nb = execute(ROOT / "notebooks" / "steering.ipynb")
    result = summary(nb)
    gaps = result["logit_gap"]
    assert result["alphas"] == [-12, -8, -4, 0, 4, 8, 12]
    assert gaps == sorted(gaps) and gaps[-1] - gaps[0] > 2  # "happy" rises with alpha
    assert gaps[0] < 0 < gaps[-1]
    assert "sad" in result["texts"][0] and "happy" in result["texts"][-1]
    assert result["plain_unchanged"]
    assert num_images(nb) == 1
