"""Bounds on work instead of on seconds.

A test that guards against a hang or a blow-up (a loop over a count read from a hostile file, a
quadratic rescan, a template that never stops) bounds what the code *does*, not how long it took:
the bound then holds on any machine, under any load, with any number of test workers.

    with call_budget(50_000) as work:      # Python and C function calls, counted with sys.setprofile
        outcome = convert_gguf(path, out)
    work.calls                              # how many were made

Past the limit, WorkBudgetExceeded is raised inside the code under test, so a runaway loop fails
the test instead of hanging it. It derives from BaseException: the code's own `except Exception`
(a converter that wraps every error, a template sandbox) cannot swallow it.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

__all__ = ["WorkBudgetExceeded", "CallCounter", "call_budget"]


class WorkBudgetExceeded(BaseException):
    """The code under test made more function calls than the test allows."""


class CallCounter:
    def __init__(self, limit: int):
        self.limit, self.calls = limit, 0

    def profile(self, frame, event, arg) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1
            if self.calls > self.limit:
                raise WorkBudgetExceeded(f"more than {self.limit:,} function calls")


@contextmanager
def call_budget(limit: int):
    """Count the Python and C function calls made in the block (this thread); raise past `limit`."""
    counter = CallCounter(limit)
    previous = sys.getprofile()
    sys.setprofile(counter.profile)
    try:
        yield counter
    finally:
        sys.setprofile(previous)
