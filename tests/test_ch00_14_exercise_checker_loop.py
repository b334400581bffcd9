"""The one checker loop: it never passes a solution it did not run, and names known mistakes."""
import pytest
from helpers.exercises import accepts, not_attempted, rejects, verdict

from engine.exercises import check_cases
from engine.exercises.ch00 import check_blocks_for, check_grid_stride_indices
from engine.exercises.ch01 import check_read_header_length


def test_a_checker_without_cases_refuses_to_pass():
    with pytest.raises(ValueError, match="no cases"):
        check_cases("empty", abs, [])


def test_unattempted_crashing_and_wrong_answers_never_pass(capsys):
    assert check_cases("double", not_attempted, [((2,), 4)]) is False
    assert verdict(capsys).startswith("[ ]")
    assert check_cases("double", lambda x: 1 / 0, [((2,), 4)]) is False
    assert "raised ZeroDivisionError" in verdict(capsys)
    hints = [("you added instead of multiplying", lambda x: x + 2)]
    assert check_cases("double", lambda x: x + x + (x == 3), [((2,), 4), ((3,), 6)], hints=hints) is False
    assert verdict(capsys) == "[x] double: <lambda>(3) returned 7, expected 6"
    assert check_cases("double", lambda x: x + 2, [((3,), 6)], hints=hints) is False
    assert verdict(capsys).endswith("-- it looks like you added instead of multiplying")


def test_a_hint_that_does_not_apply_is_skipped(capsys):
    hints = [("bad hint", lambda x: 1 / 0), ("an off-by-one", lambda x: 2 * x + 1)]
    assert check_cases("double", lambda x: 2 * x + 1, [((3,), 6)], hints=hints) is False
    assert verdict(capsys).endswith("-- it looks like an off-by-one")


def test_chapter_00_01_checkers(capsys):
    accepts(check_blocks_for, lambda n, t: -(-n // t), capsys)
    rejects(check_blocks_for, lambda n, t: n // t, capsys)
    accepts(check_grid_stride_indices, lambda t, n, total: list(range(t, n, total)), capsys)
    accepts(check_read_header_length, lambda b: int.from_bytes(b, "little"), capsys)
    rejects(check_read_header_length, lambda b: int.from_bytes(b, "big"), capsys)
