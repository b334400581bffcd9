"""Every chapter notebook (and its solutions) runs top to bottom on this machine, from its own folder.

Each kernel starts in the notebook's folder (chapters/ or chapters/solutions/), as JupyterLab opens it,
so a path that only resolves from one of them fails here. On a CPU-only machine the GPU cells print
that they were skipped and why; on a GPU machine they run.
"""
from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("*.ipynb")) + sorted((CHAPTERS / "solutions").glob("*.ipynb"))
# the one notebook of the fast subset (`-m "not slow"`): a few seconds; the others take from ten
# seconds to a few minutes on a CPU (the real model generating)
FAST = {"01_safetensors.ipynb"}


def _param(path: Path):
    name = path.relative_to(CHAPTERS).as_posix()
    return pytest.param(path, id=name, marks=() if name in FAST else pytest.mark.slow)


@pytest.mark.notebook
@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_notebook_runs(path, default_model_dir):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})   # the kernel's cwd
    client.execute()   # raises CellExecutionError (with the cell and traceback) on any failure
