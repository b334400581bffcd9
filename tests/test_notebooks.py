"""Every chapter notebook (and its solutions) runs top to bottom on this machine.

On a CPU-only machine the GPU cells print that they were skipped and why; on a GPU machine they run.
"""
from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("*.ipynb")) + sorted((CHAPTERS / "solutions").glob("*.ipynb"))


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.relative_to(CHAPTERS).as_posix() for p in NOTEBOOKS])
def test_notebook_runs(path, default_model_dir):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(CHAPTERS)}})
    client.execute()   # raises CellExecutionError (with the cell and traceback) on any failure
