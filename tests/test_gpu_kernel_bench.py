"""Every check `python -m engine.kernel_bench` runs, as pytest cases (GPU only; skipped elsewhere).

kernel_bench prints a table; here a kernel whose output leaves its tolerance fails the test run,
naming the kernel, the shape and the error. One test per kernel group of engine.bench.kernels.ALL,
so a new group added there is checked here without editing this file.
"""
import pytest

from engine.bench.kernels import ALL, Bench

pytestmark = pytest.mark.gpu   # skipped without a usable GPU (tests/conftest.py)


@pytest.fixture(scope="module")
def bench():
    return Bench(quick=True)


@pytest.mark.parametrize("group", ALL)
def test_kernel_within_tolerance(bench, group):
    first = len(bench.rows)
    bench.run([group])
    rows = bench.rows[first:]
    assert rows, f"kernel_bench group {group!r} checked nothing"
    bad = [f"{r['kernel']} [{r['shape']}]: rel_err {r['rel_err']:.3g} > tol {r['tol']:.3g}"
           for r in rows if not r["ok"]]
    assert not bad, "\n".join(bad)
