"""examples/quickstart.ipynb executes top to bottom (CPU in CI) in a kernel of this interpreter."""

import os
import pathlib
import sys

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
kernelspec = pytest.importorskip("ipykernel.kernelspec")

ROOT = pathlib.Path(__file__).absolute().parent.parent
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
KERNEL = "jax-sparse-mla-test"


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    # A kernelspec of our own that runs sys.executable, found first on JUPYTER_PATH: the notebook runs
    # in this environment whatever kernels the machine has registered.
    kernelspec.install(kernel_name=KERNEL, prefix=str(tmp_path))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # Agg rendering to PNG outputs
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=120,
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "dense " in text and "sparse" in text and "masked" in text and "scoring absent" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the top-k plot is missing"
    assert sys.executable  # the kernel ran this interpreter (see the kernelspec above)
