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


@pytest.mark.gpu
def test_ladder_command_writes_a_run_that_reads_back(tmp_path, capsys):
    """`--ladder rmsnorm --no-sweep`: every version checked and timed on this GPU; the JSON follows
    the schema the CPU display reads, with a time, a bandwidth and a speedup for every timed row."""
    import json

    from engine.bench import ladder
    from engine.bench.kernels import main
    path = tmp_path / "run.json"
    assert main(["--ladder", "rmsnorm", "--no-sweep", "--json", str(path)]) == 0
    run = ladder.validate_run(json.loads(path.read_text()))
    rows = run["ladders"][0]["rows"]
    assert {r["version"] for r in rows} == {r.version for r in ladder.RMSNORM.rungs}
    timed = [r for r in rows if r["timed"] and "skipped" not in r]
    assert timed and all(r["ok"] and r["us"] > 0 and r["gbps"] > 0 and r["speedup"] > 0 for r in timed)
    assert "-- T=2047 H=2048" in capsys.readouterr().out
