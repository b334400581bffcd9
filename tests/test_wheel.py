"""The wheel ships the CUDA sources and runs from wherever it is installed.

The repository keeps its kernels at the top level (kernels_cu/); pyproject.toml maps that folder into
the package as engine/kernels_cu, and engine.backend.KERNELS_DIR looks there first. This test builds
the wheel from a copy of the sources, installs it into a fresh virtual environment outside the
checkout, and from a third folder checks that the installed engine (not the checkout, not the
editable install) finds every kernel source inside itself and answers a chat prompt.

The fresh environment reuses this one's third-party packages through a .pth file that lists this
environment's site-packages: a path listed there is put on sys.path, but the .pth files inside it
(the editable install's finder among them) are not run, so the checkout stays invisible.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKOUT_KERNELS = ROOT / "kernels_cu"
BUILD_INPUTS = ("pyproject.toml", "README.md", "engine", "kernels_cu")   # what the build reads
KERNEL_SUFFIXES = (".cu", ".cuh")
# what would point a child process at the checkout or at this environment
UNSET = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "ENGINE_KERNELS_DIR", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")

pytestmark = pytest.mark.slow


def kernel_sources(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.suffix in KERNEL_SUFFIXES)


def engine_modules() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "engine").rglob("*.py") if "__pycache__" not in p.parts)


def clean_env() -> dict[str, str]:
    """This process's environment without what would point a child at the checkout or this venv."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(PYTHONFAULTHANDLER="1", PYTHONDONTWRITEBYTECODE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run cmd; on a hang, SIGABRT makes Python's faulthandler (PYTHONFAULTHANDLER=1) print where it
    was stuck before the test fails."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built (no dependencies, no build isolation: this environment's setuptools) from a copy
    of the sources, so the build leaves no build/ or egg-info behind in the checkout."""
    base = tmp_path_factory.mktemp("wheel-build")
    src = base / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = base / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
           "-w", str(out), str(src)]
    result = run(cmd, cwd=base, env=clean_env(), timeout=180)
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout}\n{result.stderr}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment (outside the checkout) with the wheel installed; its python."""
    home = tmp_path_factory.mktemp("wheel-venv")
    assert ROOT not in home.resolve().parents, "the fresh environment must live outside the checkout"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(home / "venv")
    python = home / "venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # Install first, while the new environment sees nothing but itself (pip then neither finds nor
    # touches this environment's editable install), through this environment's pip.
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
           "--no-cache-dir", "-q", str(wheel)]
    result = run(cmd, cwd=home, env=clean_env(), timeout=180)
    assert result.returncode == 0, f"installing the wheel failed:\n{result.stdout}\n{result.stderr}"
    # Then lend it this environment's third-party packages (numpy, regex, jinja2, gguf, ...).
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  cwd=home, env=clean_env(), timeout=60).stdout.strip()
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "zz_borrowed_site_packages.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


def test_wheel_holds_every_kernel_source_and_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f"engine/kernels_cu/{s}" for s in kernel_sources(CHECKOUT_KERNELS) if f"engine/kernels_cu/{s}" not in names]
    assert not missing, f"kernel sources missing from the wheel: {missing}"
    missing = [m for m in engine_modules() if m not in names]
    assert not missing, f"modules missing from the wheel (a new package for [tool.setuptools] packages?): {missing}"
    data = ("engine/serve/dashboard/index.html", "engine/serve/dashboard/dashboard.js",
            "engine/serve/dashboard/dashboard.css", "engine/exercises/recorded/gpu_run.json")
    assert all(d in names for d in data), [d for d in data if d not in names]


def test_installed_package_finds_its_kernels(installed, tmp_path):
    probe = ("import json, engine, engine.backend as b, engine.ops.paged_attention as pa; "
             "print(json.dumps({'engine': engine.__file__, 'kernels': str(b.KERNELS_DIR), 'naive': str(pa.NAIVE_SOURCE)}))")
    result = run([str(installed), "-c", probe], cwd=tmp_path, env=clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    venv_root = installed.parent.parent.resolve()
    package = Path(found["engine"]).resolve().parent
    assert venv_root in package.parents, f"engine imported from {found['engine']}, not from the fresh environment"
    kernels = Path(found["kernels"])
    assert kernels == package / "kernels_cu", f"KERNELS_DIR is {kernels}, not inside the installed package {package}"
    assert ROOT not in kernels.resolve().parents
    assert set(kernel_sources(CHECKOUT_KERNELS)) <= set(kernel_sources(kernels))
    assert Path(found["naive"]).is_file()


def test_installed_chat_answers(installed, tiny_chat_dir, tmp_path):
    cmd = [str(installed), "-m", "engine.chat", "--model", str(tiny_chat_dir), "--backend", "numpy",
           "--prompt", "hi", "--max-new-tokens", "4"]
    result = run(cmd, cwd=tmp_path, env=clean_env(), timeout=120)
    assert result.returncode == 0, f"chat failed:\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout, f"the chat printed nothing (stderr: {result.stderr})"
