"""Checkers for the chapter exercises: engine.exercises.chNN.check_<exercise>(your_function).

Each checker calls your function on many inputs, compares with the engine's own implementation and
prints one line: [OK], [x] with the first failing input (and, when the answer matches a mistake we
have seen before, which one), or [ ] while the exercise still raises NotImplementedError (so a
notebook with unsolved exercises still runs top to bottom). It returns True only when your function
ran on every case and passed it: a checker never says [OK] for a solution it did not run. Solutions
assert the verdict (`assert check_x(x)`).

`check_cases` is the one loop every checker goes through; `call_learner` runs one call.
`model_check.check_in_model` puts your stages inside the real model.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
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
