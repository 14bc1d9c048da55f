"""Every notebook in notebooks/ runs top to bottom (code cells exec'd in one namespace, as a
kernel would), so the research entry point cannot silently rot."""

from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
    nb = json.loads(path.read_text())
    namespace: dict = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}:{cell['id']}", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "Paris" in printed  # the greedy answer of the first prompt


def test_notebooks_exist():
    assert NOTEBOOKS
