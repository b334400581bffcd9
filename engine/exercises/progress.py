"""Which checkers each participant has passed: `python -m engine.exercises.progress [DIR]`.

Every call of a chapter's checker (engine.exercises.chNN.check_*, the shared check_in_model,
check_default_model_with, ...) appends one JSON line to its participant's progress log:

    {"v": 1, "time": "2026-12-02T15:04:05Z", "participant": "ana", "chapter": "03",
     "checker": "check_embedding", "status": "pass", "seconds": 0.02, "verdicts": ["[OK] embedding: ..."]}

status is "pass" (the checker returned True), "fail" (a [x] verdict, or the checker raised),
"not-tried" (the exercise still raises NotImplementedError: a [ ] verdict) or "skipped" (a GPU
checker on a machine without a GPU). engine/exercises/__init__.py writes the log: it wraps the
checkers when their module is imported, so every checker goes through its `logged_call` without
knowing it.

Where the log goes:
    ENGINE_PROGRESS_DIR   the folder of logs: one file per participant, <name>.jsonl (a room points
                          every participant at one shared folder); default ~/.llm-engine/progress
    ENGINE_PARTICIPANT    the participant's name (default: the login name)
    ENGINE_PROGRESS=off   log nothing
A test run (pytest sets PYTEST_CURRENT_TEST) logs only where ENGINE_PROGRESS_DIR points, so running the
test suite does not fill the developer's own log. Writing the log never fails a checker: a folder that
cannot be written is reported once on stderr when ENGINE_PROGRESS_DIR names it, and ignored otherwise.
Each record is one os.write on a file opened with O_APPEND, so two notebooks of one participant
appending at the same time do not interleave their lines.

The report reads logs written by other people's machines, so it is bounded: at most MAX_FILES files,
the last MAX_FILE_BYTES of each, lines of at most MAX_LINE_CHARS; a line that is not a well-formed
record is skipped and counted, never fatal.

    python -m engine.exercises.progress                  # your own log (or the room's, with ENGINE_PROGRESS_DIR)
    python -m engine.exercises.progress /shared/room     # the room: participant x checker
    python -m engine.exercises.progress DIR --participant ana --chapter 03
    python -m engine.exercises.progress DIR --json
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import stat
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.exercises import PROGRESS_STATUSES, chapter_of_module, chapter_of_notebook, progress_dir, safe_name

MAX_FILES = 500                 # participants' logs read from one folder
MAX_FILE_BYTES = 4 * 2**20      # the tail of each log that is read (the latest attempts)
MAX_LINE_CHARS = 8192           # a longer line is not a record

_CHECKER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,79}$")
_CHAPTER_ID = re.compile(r"^(\d\d|appendix_[a-z0-9]+|[a-z_]{1,40})$")
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


# ---------------------------------------------------------------- reading

@dataclass
class Attempts:
    """One participant's attempts at one checker."""
    status: str              # of the latest attempt
    last: str                # its time, ISO 8601 UTC
    attempts: int = 0
    passed_once: bool = False
    verdict: str = ""        # the latest attempt's first verdict line


@dataclass
class Room:
    source: str
    progress: dict[str, dict[tuple[str, str], Attempts]] = field(default_factory=dict)
    malformed_lines: int = 0
    bytes_not_read: int = 0       # beyond MAX_FILE_BYTES (the oldest records of huge logs)
    files_not_read: list[str] = field(default_factory=list)   # unreadable, not regular, beyond MAX_FILES


def _valid(record: Any) -> bool:
    if not isinstance(record, dict):
        return False
    chapter, checker, status, when = (record.get(k) for k in ("chapter", "checker", "status", "time"))
    if not (isinstance(chapter, str) and _CHAPTER_ID.match(chapter) and isinstance(checker, str)
            and _CHECKER_NAME.match(checker) and status in PROGRESS_STATUSES and isinstance(when, str) and len(when) <= 40):
        return False
    try:
        _parse_time(when)
    except ValueError:
        return False
    verdicts = record.get("verdicts", [])
    return isinstance(verdicts, list) and all(isinstance(v, str) for v in verdicts)


def _parse_time(when: str) -> datetime.datetime:
    parsed = datetime.datetime.fromisoformat(when.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)


def _read_tail(path: Path) -> tuple[str, int]:
    """The last MAX_FILE_BYTES of a regular file, starting at a line boundary; and the bytes not read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        skipped = max(0, size - MAX_FILE_BYTES)
        f.seek(max(0, skipped - 1))
        data = f.read(MAX_FILE_BYTES + (skipped > 0))
    if skipped:      # data starts one byte early: a newline there means the tail starts with a whole line
        cut = data.find(b"\n")
        skipped += max(0, cut)
        data = b"" if cut < 0 else data[cut + 1:]
    return data.decode("utf-8", errors="replace"), skipped


def read_room(source: Path | str) -> Room:
    """Every participant's attempts in a folder of logs (or one log file)."""
    source = Path(source)
    room = Room(str(source))
    if source.is_dir():
        try:
            files = sorted(p for p in source.iterdir() if p.name.endswith(".jsonl"))
        except OSError as exc:
            room.files_not_read.append(f"{source} ({exc.strerror or exc})")
            files = []
    else:
        files = [source] if source.exists() else []
    for extra in files[MAX_FILES:]:
        room.files_not_read.append(f"{extra.name} (more than {MAX_FILES} logs)")
    for path in files[:MAX_FILES]:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                room.files_not_read.append(f"{path.name} (not a regular file)")
                continue
            text, not_read = _read_tail(path)
        except OSError as exc:
            room.files_not_read.append(f"{path.name} ({exc.strerror or exc})")
            continue
        room.bytes_not_read += not_read
        name = safe_name(path.name[:-len(".jsonl")] if path.name.endswith(".jsonl") else path.stem)
        _add_lines(room, name, text.split("\n"))     # not splitlines(): a record may hold U+2028 or U+0085
    return room


def _add_lines(room: Room, name: str, lines: Iterable[str]) -> None:
    mine = room.progress.setdefault(name, {})
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line) if len(line) <= MAX_LINE_CHARS else None
        except ValueError:      # json.JSONDecodeError, and numbers too long to convert
            record = None
        if not _valid(record):
            room.malformed_lines += 1
            continue
        assert isinstance(record, dict)
        key = (record["chapter"], record["checker"])
        verdicts = record.get("verdicts") or [""]
        seen = mine.get(key)
        if seen is None:
            seen = mine[key] = Attempts(record["status"], record["time"])
        if _parse_time(record["time"]) >= _parse_time(seen.last):     # the log's order breaks ties
            seen.status, seen.last, seen.verdict = record["status"], record["time"], verdicts[0]
        seen.attempts += 1
        seen.passed_once = seen.passed_once or record["status"] == "pass"
    if not mine:
        del room.progress[name]


# ---------------------------------------------------------------- the curriculum's checkers

def curriculum_checkers(package_dir: Path | None = None, chapters_dir: Path | None = None) -> list[tuple[str, str]]:
    """(chapter, checker) for every checker a chapter asks for, in the chapter's order: the check_*
    calls in each chapter notebook that name a checker of engine/exercises; without the notebooks
    (an installed wheel), the check_* functions each chapter's module defines."""
    package_dir = Path(__file__).parent if package_dir is None else package_dir
    chapters_dir = package_dir.parents[1] / "chapters" if chapters_dir is None else chapters_dir
    defined: dict[str, list[str]] = {}
    for path in sorted(package_dir.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        defined[path.stem] = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("check_")]
    known = {name for names in defined.values() for name in names}
    found: list[tuple[str, str]] = []
    notebooks = sorted(chapters_dir.glob("*.ipynb")) if chapters_dir.is_dir() else []
    for nb in notebooks:
        chapter = chapter_of_notebook(nb.name)
        if chapter is None:
            continue
        try:
            cells = json.loads(nb.read_text(encoding="utf-8")).get("cells", [])
        except (OSError, ValueError):
            continue
        for cell in cells:
            if cell.get("cell_type") != "code":
                continue
            source = "".join(cell.get("source", []))
            for name in re.findall(r"\b(check_\w+)\s*\(", source):
                if name in known and (chapter, name) not in found:
                    found.append((chapter, name))
    if found:
        return found
    for module, names in defined.items():
        chapter = chapter_of_module(f"engine.exercises.{module}")
        if chapter:
            found += [(chapter, name) for name in names]
    return sorted(found)


# ---------------------------------------------------------------- the report

MARK = {"pass": "OK", "fail": "x", "not-tried": "[ ]", "skipped": "skip"}


def _clean(text: str, width: int | None = None) -> str:
    """Text from someone else's log, safe for a terminal (no control characters), cut to width."""
    text = _UNPRINTABLE.sub("?", text)
    return text if width is None or len(text) <= width else text[:width - 3] + "..."


def _when(iso: str, today: datetime.date) -> str:
    local = _parse_time(iso).astimezone()
    return local.strftime("%H:%M") if local.date() == today else local.strftime("%m-%d %H:%M")


def report(room: Room, checkers: list[tuple[str, str]], *, participants: list[str] | None = None,
           chapter: str | None = None) -> dict:
    """The report as data (what --json prints)."""
    names = sorted(room.progress) if participants is None else [safe_name(p) for p in participants]
    rows = list(checkers)
    for name in names:           # checkers only the logs know (another version of the course, ch15, ...)
        rows += sorted(k for k in room.progress.get(name, {}) if k not in rows)
    if chapter is not None:
        rows = [r for r in rows if r[0] == chapter]
    people = {}
    for name in names:
        mine = room.progress.get(name, {})
        cells = {f"{c}/{k}": vars(mine[(c, k)]) for c, k in rows if (c, k) in mine}
        people[name] = {
            "passed": sum(1 for c, k in rows if (c, k) in mine and mine[(c, k)].status == "pass"),
            "tried": sum(1 for c, k in rows if (c, k) in mine),
            "last": max((a.last for a in mine.values()), default=None, key=lambda t: _parse_time(t)),
            "checkers": cells,
        }
    return {
        "source": room.source,
        "checkers": [f"{c}/{k}" for c, k in rows],
        "participants": people,
        "malformed_lines": room.malformed_lines,
        "bytes_not_read": room.bytes_not_read,
        "files_not_read": room.files_not_read,
    }


def format_table(data: dict) -> str:
    today = datetime.datetime.now().astimezone().date()
    names = list(data["participants"])
    out = [f"progress in {_clean(data['source'])}: {len(names)} participant{'s' * (len(names) != 1)}"]
    if not names:
        out.append("no checker results yet (each checker call appends a line to <participant>.jsonl here)")
    elif len(names) == 1:
        name = names[0]
        out.append(f"{'chapter/checker':40} {'status':6} {'last':11} {'tries':>5}  latest verdict")
        for key in data["checkers"]:
            a = data["participants"][name]["checkers"].get(key)
            if a is None:
                out.append(f"{_clean(key, 40):40} {'-':6}")
            else:
                out.append(f"{_clean(key, 40):40} {MARK[a['status']]:6} {_when(a['last'], today):11} "
                           f"{a['attempts']:5}  {_clean(a['verdict'], 70)}")
    else:
        width = max(11, *(min(len(n), 16) for n in names))
        out.append(f"{'chapter/checker':40} " + " ".join(f"{_clean(n, width):{width}}" for n in names))
        for key in data["checkers"]:
            cells = []
            for name in names:
                a = data["participants"][name]["checkers"].get(key)
                cells.append(f"{'-':{width}}" if a is None else
                             f"{MARK[a['status']] + ' ' + _when(a['last'], today):{width}}")
            out.append(f"{_clean(key, 40):40} " + " ".join(cells))
    total = len(data["checkers"])
    for name in names:
        p = data["participants"][name]
        last = _when(p["last"], today) if p["last"] else "never"
        out.append(f"{_clean(name, 16):16} passed {p['passed']}/{total}, tried {p['tried']}, last attempt {last}")
    if names:
        out.append("OK passed, x failed, [ ] still raises NotImplementedError, skip needs a GPU, - not run; "
                   "times are the latest attempt's (local time)")
    if data["malformed_lines"]:
        out.append(f"skipped {data['malformed_lines']} malformed line{'s' * (data['malformed_lines'] != 1)}")
    if data["bytes_not_read"]:
        out.append(f"read only the last {MAX_FILE_BYTES // 2**20} MiB of large logs ({data['bytes_not_read']:,} bytes "
                   "of older attempts not read)")
    for entry in data["files_not_read"][:10]:
        out.append(f"not read: {_clean(entry, 120)}")
    if len(data["files_not_read"]) > 10:
        out.append(f"not read: {len(data['files_not_read']) - 10} more files")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.exercises.progress",
                                 description="Which exercise checkers pass, per participant.")
    ap.add_argument("source", nargs="?", default=None,
                    help="a folder of <participant>.jsonl logs or one log (default: $ENGINE_PROGRESS_DIR "
                         "or ~/.llm-engine/progress)")
    ap.add_argument("--participant", action="append", help="only this participant (repeatable)")
    ap.add_argument("--chapter", help="only this chapter (03, 11, appendix_qwen)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    source = Path(args.source).expanduser() if args.source else progress_dir()
    if not source.exists():
        print(f"progress: {source} does not exist (no checker has run with this log folder yet; "
              "set ENGINE_PROGRESS_DIR or pass the room's folder)", file=sys.stderr)
        return 1
    data = report(read_room(source), curriculum_checkers(), participants=args.participant, chapter=args.chapter)
    print(json.dumps(data, indent=1) if args.json else format_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
