"""Checkers for the chapter exercises: engine.exercises.chNN.check_<exercise>(your_function).

Each checker calls your function on many inputs, compares with the engine's own implementation and
prints one line: [OK], [x] with the first failing input, or [ ] while the exercise still raises
NotImplementedError (so a notebook with unsolved exercises still runs top to bottom). It returns
True only when every case passes.
"""
