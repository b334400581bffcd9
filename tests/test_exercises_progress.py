"""The progress log (engine/exercises/__init__.py writes it, engine/exercises/progress.py reads it):
real checker calls append their verdicts, a room's folder becomes one table, and logs written by other
machines (malformed lines, huge files, odd files) are read within bounds without crashing."""
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers.exercises import not_attempted, verdict

import engine.exercises as exercises
from engine.exercises import append_record, logged, progress
from engine.exercises.ch00 import check_blocks_for
from engine.exercises.ch01 import check_read_header_length

ROOT = Path(__file__).resolve().parents[1]


def right_blocks(n, threads):
    return -(-n // threads)


def wrong_blocks(n, threads):       # the classic mistake: rounds down
    return n // threads


@pytest.fixture
def room(tmp_path, monkeypatch):
    folder = tmp_path / "room"
    monkeypatch.setenv("ENGINE_PROGRESS_DIR", str(folder))
    monkeypatch.setenv("ENGINE_PARTICIPANT", "ana")
    monkeypatch.delenv("ENGINE_PROGRESS", raising=False)
    return folder


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def record(chapter, checker, status, time, name="ana", verdicts=()):
    return {"v": 1, "time": time, "participant": name, "chapter": chapter, "checker": checker,
            "status": status, "seconds": 0.01, "verdicts": list(verdicts)}


def test_real_checker_calls_are_logged_with_their_verdicts(room, capsys):
    assert check_blocks_for(wrong_blocks) is False
    wrong_line = verdict(capsys)              # the checker still prints its verdict, last
    assert check_blocks_for(not_attempted) is False
    assert check_blocks_for(right_blocks) is True
    assert verdict(capsys).startswith("[OK] blocks_for")
    assert check_read_header_length(lambda b: int.from_bytes(b, "big")) is False
    log = records(room / "ana.jsonl")
    assert [(r["chapter"], r["checker"], r["status"]) for r in log] == [
        ("00", "check_blocks_for", "fail"), ("00", "check_blocks_for", "not-tried"),
        ("00", "check_blocks_for", "pass"), ("01", "check_read_header_length", "fail")]
    assert log[0]["verdicts"] == [wrong_line] and "rounds DOWN" in wrong_line
    assert log[1]["verdicts"][0].startswith("[ ] blocks_for: not attempted")
    assert all(r["participant"] == "ana" and r["v"] == 1 and r["time"].endswith("Z") for r in log)


def test_the_checkers_are_wrapped_once_and_keep_their_identity():
    assert check_blocks_for.__wrapped__.__name__ == "check_blocks_for"
    assert check_blocks_for.__module__ == "engine.exercises.ch00"
    assert logged(check_blocks_for) is check_blocks_for
    assert isinstance(exercises.ch00.__loader__, exercises._LoggedLoader)


def test_a_checker_inside_a_checker_is_one_attempt(room):
    def check_inner(fn):
        return exercises.check_cases("inner", fn, [((2,), 4)])

    check_inner.__module__ = "engine.exercises.ch06"
    inner = logged(check_inner)

    def check_outer(fn):
        return inner(fn) and inner(fn)

    check_outer.__module__ = "engine.exercises.ch07"
    assert logged(check_outer)(lambda x: 2 * x) is True
    assert [(r["chapter"], r["checker"]) for r in records(room / "ana.jsonl")] == [("07", "check_outer")]


def test_a_shared_checker_is_credited_to_the_notebook_that_calls_it(room, monkeypatch):
    def check_in_model(fn):
        return exercises.check_cases("in model", fn, [((1,), 1)])

    check_in_model.__module__ = "engine.exercises.model_check"
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/ana/llm/chapters/05_rope.ipynb")
    assert logged(check_in_model)(lambda x: x) is True
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/ana/llm/chapters/solutions/appendix_qwen_solutions.ipynb")
    assert logged(check_in_model)(lambda x: x + 1) is False
    assert [(r["chapter"], r["status"]) for r in records(room / "ana.jsonl")] == [("05", "pass"), ("appendix_qwen", "fail")]


def test_a_checker_that_raises_is_logged_and_still_raises(room):
    def check_broken(fn):
        raise ValueError("no cases")

    check_broken.__module__ = "engine.exercises.ch13"
    with pytest.raises(ValueError, match="no cases"):
        logged(check_broken)(abs)
    (only,) = records(room / "ana.jsonl")
    assert only["status"] == "fail" and only["verdicts"] == ["[x] check_broken raised ValueError: no cases"]


def test_an_unwritable_log_never_fails_a_checker(tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("ENGINE_PROGRESS_DIR", str(blocked))
    monkeypatch.setattr(exercises, "_warned", [])
    assert check_blocks_for(right_blocks) is True
    assert check_blocks_for(wrong_blocks) is False
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].startswith("[OK] blocks_for")
    assert captured.err.count("progress: not logging") == 1        # said once, not at every checker


def test_logging_off_and_test_runs_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ENGINE_PROGRESS_DIR", raising=False)
    check_blocks_for(right_blocks)                      # under pytest, without a folder named: nothing
    assert not (tmp_path / ".llm-engine").exists()
    monkeypatch.setenv("ENGINE_PROGRESS_DIR", str(tmp_path / "room"))
    monkeypatch.setenv("ENGINE_PROGRESS", "off")
    check_blocks_for(right_blocks)
    assert not (tmp_path / "room").exists()


def test_names_become_safe_file_names(room, monkeypatch):
    monkeypatch.setenv("ENGINE_PARTICIPANT", "../../etc/Ana María")
    check_blocks_for(right_blocks)
    (log,) = room.iterdir()
    assert log.name == "_.._etc_Ana_Mar_a.jsonl" and log.parent == room


def test_concurrent_appends_do_not_interleave(tmp_path):
    def append(name):
        for i in range(200):
            append_record(record("03", "check_embedding", "fail", "2026-12-02T10:00:00Z",
                                 verdicts=[f"[x] {name} {i} " + "y" * 900]), tmp_path)
    threads = [threading.Thread(target=append, args=(n,)) for n in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = (tmp_path / "ana.jsonl").read_text().splitlines()
    assert len(lines) == 800 and all(json.loads(line)["checker"] == "check_embedding" for line in lines)


def test_a_record_is_cut_to_fit(tmp_path):
    append_record(record("03", "check_embedding", "fail", "2026-12-02T10:00:00Z", verdicts=["[x] " + "z" * 10_000] * 20),
                  tmp_path)
    line = (tmp_path / "ana.jsonl").read_bytes()
    assert len(line) <= exercises.MAX_RECORD_BYTES
    assert json.loads(line)["verdicts"][0] == "[x] " + "z" * (exercises.MAX_VERDICT_CHARS - 4)


def write_room(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for r in [record("03", "check_embedding", "fail", "2026-12-02T09:40:00Z", "ana", ["[x] embedding: wrong row"]),
              record("03", "check_embedding", "pass", "2026-12-02T09:45:00Z", "ana", ["[OK] embedding: all 5 cases pass"]),
              record("04", "check_rmsnorm", "not-tried", "2026-12-02T10:05:00Z", "ana", ["[ ] rmsnorm: not attempted yet"]),
              record("03", "check_embedding", "pass", "2026-12-02T09:50:00Z", "ben"),
              record("03", "check_embedding", "fail", "2026-12-02T09:55:00Z", "ben", ["[x] embedding: index (0, 1)"]),
              record("03", "check_embedding_kernel", "skipped", "2026-12-02T09:58:00Z", "ben"),
              record("11", "check_page_allocator", "pass", "2026-12-02T15:00:00Z", "chloe")]:
        append_record(r, folder)


def test_the_room_table(tmp_path):
    write_room(tmp_path)
    data = progress.report(progress.read_room(tmp_path), progress.curriculum_checkers())
    assert list(data["participants"]) == ["ana", "ben", "chloe"]
    ana, ben = data["participants"]["ana"]["checkers"], data["participants"]["ben"]["checkers"]
    assert ana["03/check_embedding"]["status"] == "pass" and ana["03/check_embedding"]["attempts"] == 2
    assert ben["03/check_embedding"]["status"] == "fail"       # the latest attempt counts...
    assert ben["03/check_embedding"]["passed_once"] is True    # ...and the earlier pass is remembered
    assert ben["03/check_embedding"]["verdict"] == "[x] embedding: index (0, 1)"
    assert data["participants"]["chloe"]["passed"] == 1 and data["participants"]["ana"]["tried"] == 2
    assert "02/check_merge_loop" in data["checkers"]            # never tried by anyone, still a row
    table = progress.format_table(data)
    header = next(line for line in table.splitlines() if line.startswith("chapter/checker"))
    assert header.split()[1:] == ["ana", "ben", "chloe"]
    row = next(line for line in table.splitlines() if line.startswith("03/check_embedding "))
    assert re.match(r"^03/check_embedding +OK [0-9:-]+( [0-9:]+)? +x [0-9:-]+( [0-9:]+)? +- *$", row), row
    assert "skip" in next(line for line in table.splitlines() if line.startswith("03/check_embedding_kernel"))
    assert "[ ]" in next(line for line in table.splitlines() if line.startswith("04/check_rmsnorm "))
    assert any(line.startswith("ana") and "passed 1/" in line for line in table.splitlines())


def test_one_participant_gets_the_latest_verdicts(tmp_path):
    write_room(tmp_path)
    table = progress.format_table(progress.report(progress.read_room(tmp_path / "ben.jsonl"),
                                                  progress.curriculum_checkers(), chapter="03"))
    assert "1 participant" in table
    row = next(line for line in table.splitlines() if line.startswith("03/check_embedding "))
    assert " x " in row and row.rstrip().endswith("[x] embedding: index (0, 1)") and " 2  " in row
    assert not any(line.startswith("04/") for line in table.splitlines())


def test_malformed_lines_are_skipped_and_counted(tmp_path):
    good = json.dumps(record("05", "check_rope", "pass", "2026-12-02T11:00:00Z"))
    bad = ["{not json", "[1, 2]", "null", json.dumps(record("05", "check_rope", "won", "2026-12-02T11:00:00Z")),
           json.dumps(record("05", "check rope; rm -rf", "pass", "2026-12-02T11:00:00Z")),
           json.dumps(record("05", "check_rope", "pass", "yesterday")),
           json.dumps(record("05", "check_rope", "pass", "2026-12-02T11:00:00Z") | {"verdicts": "[OK]"}),
           json.dumps(record("05", "check_rope", "pass", "2026-12-02T11:00:00Z", verdicts=["x" * 9000])),
           "1" * 5000, "\x00\x01\x02", '{"chapter": "05"']          # the last: a line cut by a crash
    (tmp_path / "dan.jsonl").write_bytes(("\n".join([bad[0], good, *bad[1:]]) + "\n").encode() + b"\xff\xfe\n")
    room = progress.read_room(tmp_path)
    assert room.malformed_lines == len(bad) + 1
    assert room.progress["dan"][("05", "check_rope")].status == "pass"
    assert "skipped 12 malformed lines" in progress.format_table(progress.report(room, []))


def test_a_huge_log_is_read_from_its_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "MAX_FILE_BYTES", 4096)
    old = "\n".join(json.dumps(record("06", "check_softmax", "fail", f"2026-12-02T10:{i % 60:02d}:00Z"))
                    for i in range(200))
    latest = json.dumps(record("06", "check_softmax", "pass", "2026-12-02T12:00:00Z"))
    (tmp_path / "eve.jsonl").write_text(old + "\n" + latest + "\n")
    room = progress.read_room(tmp_path)
    attempts = room.progress["eve"][("06", "check_softmax")]
    assert attempts.status == "pass" and attempts.attempts < 30          # only the tail was read
    assert room.malformed_lines == 0 and room.bytes_not_read >= (tmp_path / "eve.jsonl").stat().st_size - 4096


def test_odd_files_in_the_folder_are_not_read(tmp_path, monkeypatch):
    write_room(tmp_path)
    (tmp_path / "folder.jsonl").mkdir()
    os.mkfifo(tmp_path / "pipe.jsonl")                  # opening a FIFO would block: it must not be opened
    (tmp_path / "notes.txt").write_text("not a log")
    room = progress.read_room(tmp_path)
    assert sorted(room.progress) == ["ana", "ben", "chloe"]
    assert sorted(e.split()[0] for e in room.files_not_read) == ["folder.jsonl", "pipe.jsonl"]
    monkeypatch.setattr(progress, "MAX_FILES", 2)
    room = progress.read_room(tmp_path)
    assert len(room.progress) <= 2 and any("more than 2 logs" in e for e in room.files_not_read)


def test_the_curriculum_lists_every_chapter_checker_in_order():
    checkers = progress.curriculum_checkers()
    assert checkers[0] == ("00", "check_blocks_for")
    assert {("03", "check_embedding"), ("03", "check_in_model"), ("10", "check_scheduler"),
            ("11", "check_page_allocator"), ("appendix_qwen", "check_qk_norm")} <= set(checkers)
    assert checkers.index(("03", "check_embedding")) < checkers.index(("03", "check_in_model"))
    assert not any(name == "check_cases" for _, name in checkers)
    without_notebooks = progress.curriculum_checkers(chapters_dir=ROOT / "no-such-folder")
    assert ("00", "check_blocks_for") in without_notebooks and ("03", "check_in_model") not in without_notebooks


def test_the_command(tmp_path, capsys):
    write_room(tmp_path)
    assert progress.main([str(tmp_path), "--json", "--participant", "ben"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["participants"]) == ["ben"] and data["malformed_lines"] == 0
    assert progress.main([str(tmp_path / "nobody-here")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_python_m_runs_it(tmp_path):
    write_room(tmp_path)
    env = {**os.environ, "ENGINE_PROGRESS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "engine.exercises.progress"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""                             # no runpy warning about the module imported twice
    assert done.stdout.startswith(f"progress in {tmp_path}: 3 participants")


def test_the_tail_keeps_a_line_that_starts_at_the_cut(tmp_path, monkeypatch):
    lines = [json.dumps(record("06", "check_softmax", "fail", f"2026-12-02T10:{i:02d}:00Z")) + "\n" for i in range(10)]
    assert len({len(line) for line in lines}) == 1
    (tmp_path / "eve.jsonl").write_text("".join(lines))
    monkeypatch.setattr(progress, "MAX_FILE_BYTES", 4 * len(lines[0]))     # exactly the last four lines
    room = progress.read_room(tmp_path)
    assert room.progress["eve"][("06", "check_softmax")].attempts == 4
    assert room.malformed_lines == 0 and room.bytes_not_read == 6 * len(lines[0])


def test_a_truthy_report_passes_and_a_falsy_one_fails(room):
    class Report:                                   # like model_check.ModelCheck: truthy only on a full match
        def __init__(self, ok):
            self.ok = ok

        def __bool__(self):
            return self.ok

    def check_in_model(ok):
        print("[OK] your embedding inside the model" if ok else "[x] your embedding inside the model: diverged")
        return Report(ok)

    check_in_model.__module__ = "engine.exercises.ch03"
    assert logged(check_in_model)(True) and not logged(check_in_model)(False)
    assert [r["status"] for r in records(room / "ana.jsonl")] == ["pass", "fail"]
