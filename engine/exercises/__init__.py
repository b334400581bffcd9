"""Checkers for the chapter exercises: engine.exercises.chNN.check_<exercise>(your_function).

Each checker calls your function on many inputs, compares with the engine's own implementation and
prints one line: [OK], [x] with the first failing input (and, when the answer matches a mistake we
have seen before, which one), or [ ] while the exercise still raises NotImplementedError (so a
notebook with unsolved exercises still runs top to bottom). It returns True only when your function
ran on every case and passed it: a checker never says [OK] for a solution it did not run. Solutions
assert the verdict (`assert check_x(x)`).

`check_cases` is the one loop every checker goes through; `call_learner` runs one call.
`model_check.check_in_model` puts your stages inside the real model.

Every checker call is also appended to the participant's progress log, which the instructor reads with
`python -m engine.exercises.progress` (engine/exercises/progress.py, which describes the log): importing
a checker module (chNN, appendix_*, model_check, serving_check, cuda_check) wraps its public check_*
functions, so the log sees every checker, whichever loop prints its verdicts. The writing half lives
here, with the import hook, because this package's initialisation imports no engine module.
"""
from __future__ import annotations

import contextvars
import copy
import datetime
import functools
import getpass
import importlib.abc
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

Hint = tuple[str, Callable]   # (what the mistake is, a function computing the mistaken answer from the args)


def call_learner(title: str, call: str, fn, *args) -> tuple[bool, Any]:
    """Run the learner's function: (True, its result), or (False, None) after printing why not
    ('[ ]' while it still raises NotImplementedError, '[x]' with the exception it raised)."""
    try:
        return True, fn(*args)
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] {title}: {call} raised {type(e).__name__}: {e}")
    return False, None


def default_label(fn, args: tuple) -> str:
    """How a call is shown: fn(arg, arg, ...) with reprs."""
    return f"{getattr(fn, '__name__', 'fn')}({', '.join(repr(a) for a in args)})"


def _equal(got, want) -> bool:
    return got == want


def _safe(test: Callable, *args) -> bool:
    """A comparison that may not apply to a wrong answer's type counts as 'not the same'."""
    try:
        return bool(test(*args))
    except Exception:
        return False


def check_cases(title: str, fn: Callable, cases: Iterable[tuple[tuple, Any]], *,
                same: Callable[[Any, Any], bool] = _equal, hints: Sequence[Hint] = (),
                label: Callable[[Callable, tuple], str] = default_label,
                explain: Callable[[Any, Any], str | None] | None = None, copy_args: bool = False,
                passed: str | None = None) -> bool:
    """The checker loop: call fn(*args) for each (args, expected); print one verdict line; True when
    every case ran and passed.

    same(got, want)    is the answer right (exceptions count as no)
    hints              (text, mistake(*args)): a wrong answer equal to a mistake's answer names it
    label(fn, args)    how the failing call is shown
    explain(got, want) why a wrong answer is wrong (default, or when it returns None: 'returned X, expected Y')
    copy_args          give fn (and each mistake) a deep copy, so in-place edits cannot leak between them
    passed             the end of the [OK] line (default: 'all N cases pass')
    """
    count = 0
    for args, want in cases:
        call = label(fn, args)
        ok, got = call_learner(title, call, fn, *(copy.deepcopy(args) if copy_args else args))
        if not ok:
            return False
        if not _safe(same, got, want):
            reason = (explain(got, want) if explain else None) or f"returned {got!r}, expected {want!r}"
            for text, mistake in hints:
                try:
                    wrong = mistake(*(copy.deepcopy(args) if copy_args else args))
                except Exception:   # a mistake that does not apply to these arguments
                    continue
                if _safe(same, got, wrong) and not _safe(same, want, wrong):
                    reason += f" -- it looks like {text}"
                    break
            print(f"[x] {title}: {call} {reason}")
            return False
        count += 1
    if count == 0:
        raise ValueError(f"the checker of {title} has no cases: it cannot pass anything")
    print(f"[OK] {title}: " + (passed or ("the case passes" if count == 1 else f"all {count} cases pass")))
    return True


# ---------------------------------------------------------------- the progress log (written here, read by progress.py)

PROGRESS_FORMAT = 1
PROGRESS_STATUSES = ("pass", "fail", "not-tried", "skipped")
MAX_RECORD_BYTES = 4096         # what one checker call appends (verdicts are cut to fit)
MAX_VERDICTS, MAX_VERDICT_CHARS = 6, 300
_CAPTURE_CHARS = 64 * 1024      # of a checker's printed output, scanned for its verdict lines
_VERDICT = re.compile(r"^\[(OK|x| |skipped)\] ")
_CHAPTER_MODULE = re.compile(r"^engine\.exercises\.(?:ch(\d\d)|(appendix_\w+))$")
_CHAPTER_FILE = re.compile(r"(?:^|[/\\])(\d\d|appendix_[a-z0-9]+)_?[\w-]*\.ipynb$")
# the modules whose check_* functions are logged
_CHECKER_MODULE = re.compile(r"^engine\.exercises\.(ch\d\d|appendix_\w+|model_check|serving_check|cuda_check)$")


def progress_dir() -> Path:
    """The folder of progress logs: $ENGINE_PROGRESS_DIR, else ~/.llm-engine/progress."""
    configured = os.environ.get("ENGINE_PROGRESS_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".llm-engine" / "progress"


def safe_name(name: str) -> str:
    """A participant's name as a file name: letters, digits, '.', '_', '-'; 64 characters at most."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", name.strip()).lstrip(".")[:64]
    return cleaned or "participant"


def participant() -> str:
    name = os.environ.get("ENGINE_PARTICIPANT", "")
    if not name.strip():
        try:
            name = getpass.getuser()
        except Exception:   # no login name (some containers): one log for the machine
            name = "participant"
    return safe_name(name)


def logging_enabled() -> bool:
    if os.environ.get("ENGINE_PROGRESS", "").strip().lower() in ("0", "off", "no", "false"):
        return False
    return "PYTEST_CURRENT_TEST" not in os.environ or bool(os.environ.get("ENGINE_PROGRESS_DIR"))


def chapter_of_module(module_name: str) -> str | None:
    """engine.exercises.ch03 -> "03", engine.exercises.appendix_qwen -> "appendix_qwen"."""
    m = _CHAPTER_MODULE.match(module_name)
    return None if m is None else (m.group(1) or m.group(2))


def chapter_of_notebook(path: str) -> str | None:
    """chapters/03_embedding.ipynb (or its solutions) -> "03"."""
    m = _CHAPTER_FILE.search(path)
    return None if m is None else m.group(1)


def _current_chapter(fn: Callable, frame: Any) -> str:
    """The chapter a checker call belongs to: the checker's own module (chNN), else a chNN checker on
    the call stack, else the notebook the kernel runs (Jupyter's session name), else the highest chapter
    whose checkers this process imported (a notebook imports its own chapter's and earlier helpers),
    else the shared module's name (model_check, serving_check)."""
    module = getattr(fn, "__module__", "") or ""
    own = chapter_of_module(module)
    if own:
        return own
    depth = 0
    while frame is not None and depth < 50:
        found = chapter_of_module(frame.f_globals.get("__name__", ""))
        if found:
            return found
        session = frame.f_globals.get("__session__") if frame.f_globals.get("__name__") == "__main__" else None
        if isinstance(session, str) and chapter_of_notebook(session):
            return chapter_of_notebook(session) or ""
        frame, depth = frame.f_back, depth + 1
    session = os.environ.get("JPY_SESSION_NAME", "")
    if chapter_of_notebook(session):
        return chapter_of_notebook(session) or ""
    imported = sorted(c for c in (chapter_of_module(m) for m in list(sys.modules)) if c and c[:2].isdigit())
    if imported:
        return imported[-1]
    return module.rsplit(".", 1)[-1] or "unknown"


_warned: list[str] = []


def append_record(record: dict, directory: Path | None = None) -> bool:
    """Append one record to its participant's log; False (never an exception) when it cannot."""
    directory = progress_dir() if directory is None else directory
    try:
        line = _encode(record)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{safe_name(str(record.get('participant', 'participant')))}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)      # one write of one whole line: appends from two kernels never interleave
        finally:
            os.close(fd)
        return True
    except Exception as exc:
        if os.environ.get("ENGINE_PROGRESS_DIR") and not _warned:
            _warned.append(str(exc))
            print(f"progress: not logging checker results to {directory} ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
        return False


def _encode(record: dict) -> bytes:
    record = dict(record)
    verdicts = [v[:MAX_VERDICT_CHARS] for v in record.get("verdicts", [])][:MAX_VERDICTS]
    while True:
        record["verdicts"] = verdicts
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        if len(line) <= MAX_RECORD_BYTES or not verdicts:
            return line
        verdicts = verdicts[:-1]


def status_of(result: Any, verdicts: list[str], raised: BaseException | None) -> str:
    """pass: the checker returned True, or a truthy report (check_in_model's ModelCheck is truthy only on
    a full match); skipped: it returned None after a [skipped] line; not-tried: a [ ] line and no [x]."""
    if raised is None and _truthy(result):
        return "pass"
    marks = [v.split("]", 1)[0] + "]" for v in verdicts]
    if raised is None and "[x]" not in marks:
        if result is None and "[skipped]" in marks:
            return "skipped"
        if "[ ]" in marks:
            return "not-tried"
    return "fail"


def _truthy(result: Any) -> bool:
    try:
        return result is not None and bool(result)
    except Exception:   # an array, or a report without a truth value: not a verdict
        return False


class _Tee:
    """sys.stdout for the length of a checker call: everything still reaches the real stream (the
    notebook, capsys), and the first _CAPTURE_CHARS are kept to find the verdict lines."""

    def __init__(self, out):
        self._out, self._kept, self._size = out, [], 0

    def write(self, text):
        self._out.write(text)
        if self._size < _CAPTURE_CHARS and isinstance(text, str):
            self._kept.append(text[:_CAPTURE_CHARS - self._size])
            self._size += len(self._kept[-1])
        return len(text)

    def flush(self):
        self._out.flush()

    def __getattr__(self, name):
        return getattr(self._out, name)

    def verdicts(self) -> list[str]:
        return [line for line in "".join(self._kept).splitlines() if _VERDICT.match(line)]


_inside_checker: contextvars.ContextVar[bool] = contextvars.ContextVar("inside_checker", default=False)


def logged_call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Call a checker; when it is the outermost checker of the call and logging is on, append its
    verdict to the participant's log. The checker's result and exceptions pass through unchanged."""
    if _inside_checker.get() or not logging_enabled():
        return fn(*args, **kwargs)
    chapter = _safe_chapter(fn)
    token = _inside_checker.set(True)
    tee = _Tee(sys.stdout)
    previous, sys.stdout = sys.stdout, tee
    start, result, raised = time.perf_counter(), None, None
    try:
        result = fn(*args, **kwargs)
        return result
    except BaseException as exc:
        raised = exc
        raise
    finally:
        if sys.stdout is tee:
            sys.stdout = previous
        _inside_checker.reset(token)
        _log(fn, chapter, result, raised, tee, time.perf_counter() - start)


def _safe_chapter(fn: Callable) -> str:
    try:
        return _current_chapter(fn, sys._getframe(2))
    except Exception:
        return "unknown"


def _log(fn, chapter, result, raised, tee, seconds) -> None:
    try:
        verdicts = tee.verdicts()
        if raised is not None:
            kind = "interrupted" if isinstance(raised, KeyboardInterrupt) else f"raised {type(raised).__name__}"
            verdicts.append(f"[x] {getattr(fn, '__name__', 'checker')} {kind}: {raised}")
        append_record({
            "v": PROGRESS_FORMAT,
            "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "participant": participant(),
            "chapter": chapter,
            "checker": getattr(fn, "__name__", "checker"),
            "status": status_of(result, verdicts, raised),
            "seconds": round(seconds, 3),
            "verdicts": verdicts,
        })
    except Exception:   # the log is a convenience: a checker's verdict never depends on it
        pass


def logged(fn: Callable) -> Callable:
    """fn, with every outermost call logged (see logged_call)."""
    if getattr(fn, "__progress_logged__", False):
        return fn

    @functools.wraps(fn)
    def checker(*args, **kwargs):
        return logged_call(fn, args, kwargs)
    checker.__progress_logged__ = True    # type: ignore[attr-defined]
    return checker


def wrap_checkers(module) -> None:
    """Replace each public check_* function defined in the module by its logged version."""
    for name, value in list(vars(module).items()):
        if (name.startswith("check_") and callable(value) and getattr(value, "__module__", None) == module.__name__
                and not isinstance(value, type)):
            setattr(module, name, logged(value))


class _LoggedLoader(importlib.abc.Loader):
    """The module's own loader, then its check_* functions wrapped by `logged`."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        wrap_checkers(module)

    def __getattr__(self, name):     # get_source, get_filename, ... (tracebacks, inspect)
        return getattr(self._loader, name)


class _CheckerModules(importlib.abc.MetaPathFinder):
    """Finds the checker modules as the other finders do and hands them to _LoggedLoader."""

    def find_spec(self, fullname, path, target=None):
        if not _CHECKER_MODULE.match(fullname):
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _CheckerModules) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoggedLoader(spec.loader)
                return spec
        return None


if not any(isinstance(f, _CheckerModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckerModules())
