"""What the exercise-checker tests share: a stand-in for an unsolved exercise and the verdict line."""
from __future__ import annotations


def not_attempted(*args):
    raise NotImplementedError


def verdict(capsys) -> str:
    """The last line the checker printed."""
    return capsys.readouterr().out.strip().splitlines()[-1]


def accepts(checker, fn, capsys, *args):
    """checker(fn, *args) passes and says [OK]."""
    assert checker(fn, *args) is True, verdict(capsys)
    assert verdict(capsys).startswith("[OK]")


def rejects(checker, fn, capsys, hint: str | None = None, *args):
    """checker(fn, *args) fails with an [x] line that contains `hint`."""
    assert checker(fn, *args) is False
    line = verdict(capsys)
    assert line.startswith("[x]"), line
    if hint is not None:
        assert hint in line, line
