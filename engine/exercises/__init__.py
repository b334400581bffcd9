"""Checkers for the chapter exercises: engine.exercises.chNN.check_<exercise>(your_function).

Each checker calls your function on many inputs, compares with the engine's own implementation and
prints one line: [OK], [x] with the first failing input, or [ ] while the exercise still raises
NotImplementedError (so a notebook with unsolved exercises still runs top to bottom). It returns
True only when every case passes.
"""


def call_learner(title: str, call: str, fn, *args) -> tuple[bool, object]:
    """Run the learner's function: (True, its result), or (False, None) after printing why not
    ('[ ]' while it still raises NotImplementedError, '[x]' with the exception it raised)."""
    try:
        return True, fn(*args)
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] {title}: {call} raised {type(e).__name__}: {e}")
    return False, None
