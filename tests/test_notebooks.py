"""The example notebooks run top to bottom on the tiny model (nbclient, a real kernel), with no
errors, and show what they are for: pictures of the request graph and the radix tree, plots,
tables and the numbers they print."""

from __future__ import annotations

import os
import pathlib
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# notebook -> (SVG pictures at least, PNG plots at least, HTML tables at least, texts printed)
NOTEBOOKS = {
    "quickstart.ipynb": (2, 0, 0, ["prefill tokens computed", "unique in the prefix tree"]),
    "batch_pipeline.ipynb": (2, 1, 0, ["prefill tokens computed", "lower bound", "independent"]),
    "structured_extraction.ipynb": (1, 0, 2, ["jumped forward"]),
    "inside_the_cache.ipynb": (5, 1, 0, ["working set", "lru:", "graph:"]),
    "agent_pipeline.ipynb": (2, 0, 0, ["prefill tokens computed", "lower bound", "independent"]),
}


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_executes_and_shows_its_pictures(name, tiny_model_dir, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("FLOWLANG_NOTEBOOK_MODEL", str(tiny_model_dir))
    notebook = nbformat.read(ROOT / "examples" / name, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    outputs = [
        o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    ]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, "\n".join(e.ename + ": " + e.evalue for e in errors)
    svgs = [o["data"]["image/svg+xml"] for o in outputs if "image/svg+xml" in o.get("data", {})]
    pngs = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    tables = [
        o["data"]["text/html"]
        for o in outputs
        if "<table" in o.get("data", {}).get("text/html", "")
    ]
    want_svgs, want_pngs, want_tables, want_texts = NOTEBOOKS[name]
    assert len(svgs) >= want_svgs and len(pngs) >= want_pngs and len(tables) >= want_tables
    for svg in svgs:
        root = ET.fromstring(svg)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        summary = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")][0]
        assert summary.startswith(("program ", "radix tree: "))
    text = "".join(o.get("text", "") for o in outputs)
    for want in want_texts:
        assert want in text, want
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Warning" not in stderr, stderr


def test_the_notebook_extra_runs_a_notebook_from_the_command_line(tiny_model_dir, tmp_path):
    """`jupyter nbconvert --execute`, as a user of `pip install -e ".[notebook]"` runs it (the
    dev extra includes that extra)."""
    import subprocess
    import sys

    import nbformat

    jupyter = pathlib.Path(sys.executable).with_name("jupyter")
    env = dict(os.environ, FLOWLANG_NOTEBOOK_MODEL=str(tiny_model_dir))
    command = [str(jupyter), "nbconvert", "--to", "notebook", "--execute"]
    command += [str(ROOT / "examples" / "quickstart.ipynb"), "--output-dir", str(tmp_path)]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    executed = nbformat.read(tmp_path / "quickstart.ipynb", as_version=4)
    outputs = [o for cell in executed.cells for o in cell.get("outputs", [])]
    assert outputs and not [o for o in outputs if o.output_type == "error"]
