"""The example notebook runs end to end in a fresh kernel and shows the pivot.

The kernel is this interpreter (a kernelspec written into tmp_path whose argv is
sys.executable), so the test runs the bitguard under test whatever kernels the machine has.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "compare_two_runs.ipynb"
PIVOT = "blocks.0.mlp.fc"  # where tinygpt's forward-bitflip fault flips a bit

pytestmark = pytest.mark.slow


@pytest.fixture
def this_python_kernel(tmp_path, monkeypatch) -> str:
    spec = tmp_path / "jupyter" / "kernels" / "bitguard-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "bitguard under test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # (the notebook's work folder: under pytest's, not /tmp's)
    return "bitguard-test"


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    return "\n".join(v if isinstance(v, str) else json.dumps(v) for v in output.get("data", {}).values())


def test_notebook_records_compares_and_shows_the_pivot(tmp_path, this_python_kernel):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in nb.cells), "commit the notebook without outputs"
    NotebookClient(nb, kernel_name=this_python_kernel, timeout=240,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()  # raises on a cell error
    outputs = {cell.source.splitlines()[-1]: [_text(o) for o in cell.outputs]
               for cell in nb.cells if cell.cell_type == "code"}
    assert not [o for cell in nb.cells for o in cell.get("outputs", []) if o.output_type == "error"]
    (summary,) = outputs["c"]
    assert '<span class="diverged">diverged</span>' in summary and f"<code>{PIVOT}</code>" in summary
    assert any(f"PIVOT: {PIVOT}" in text for text in outputs["c.timeline()"]), "the timeline names the pivot"
    assert any(f"PIVOT: {PIVOT}" in text for text in outputs["c.propagation()"])
    assert any(PIVOT in text for text in outputs["c.divergent()"])
    assert any("a_seq" in text for text in outputs["c.events().head()"])
    assert any("compare.pftrace" in text for text in outputs['c.export_perfetto(work / "compare.pftrace")'])
