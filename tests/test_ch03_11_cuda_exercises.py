"""The GPU track's checker: the mistake classifier on simulated outputs (CPU), and on a GPU every
worked solution passing its checker and deliberately broken kernels getting the right diagnosis."""
import json
import re

import numpy as np
import pytest

from engine.backend import f32_to_bf16
from engine.exercises import cuda_check, recorded
from engine.exercises.cuda_check import POISON, Case, diagnose
from engine.exercises.record_gpu import CHECKERS

GUARD = 64
rng = np.random.default_rng(0)


def bits_of(values: np.ndarray, dtype: str) -> np.ndarray:
    values = np.asarray(values, np.float32)
    return f32_to_bf16(values) if dtype == "bf16" else values.view(np.uint32)


def outcome(got: np.ndarray | None, dtype="bf16", written=None, guard_writes=0) -> np.ndarray:
    """What a launch leaves in the poisoned buffer: `got` where `written` (default: everywhere), the
    poison elsewhere, and `guard_writes` elements of the guard overwritten."""
    n = got.size
    buf = np.full(n + GUARD, POISON[dtype], dtype=cuda_check.BITS[dtype])
    mask = np.ones(n, bool) if written is None else written.reshape(-1)
    buf[:n][mask] = bits_of(got.reshape(-1), dtype)[mask]
    buf[n:n + guard_writes] = bits_of(np.zeros(guard_writes), dtype)
    return buf


WANT = rng.standard_normal((5, 577)).astype(np.float32)


def verdict(got, **kw):
    return diagnose([outcome(got, **kw)] * 3, "bf16", WANT)


def test_a_right_answer_passes():
    assert verdict(WANT) is None
    assert diagnose([outcome(WANT, "f32")] * 3, "f32", WANT, exact=True) is None


def test_writes_past_the_end_are_a_missing_bounds_check():
    assert verdict(WANT, guard_writes=11).startswith("missing bounds check: the kernel wrote 11")


def test_one_element_per_thread_leaves_the_rest_of_the_row_unwritten():
    written = np.zeros(WANT.shape, bool)
    written[:, :128] = True
    assert "only the first 128 of 577 columns" in verdict(WANT, written=written)


def test_a_grid_too_small_leaves_the_last_rows_unwritten():
    written = np.zeros(WANT.shape, bool)
    written[:2] = True
    assert "rows 2.. were never written" in verdict(WANT, written=written)


def test_nothing_written_and_scattered_holes():
    assert "no output element was written" in verdict(WANT, written=np.zeros(WANT.shape, bool))
    written = np.ones(WANT.shape, bool)
    written[3, 17] = written[1, 400] = False
    expected = "2 of 2885 output elements still hold the poison (first at row 1, column 400)"
    assert expected in verdict(WANT, written=written)


def test_a_named_region_left_unwritten():
    written = np.ones(WANT.shape, bool)
    written[:, 500:] = False
    got = diagnose([outcome(WANT, written=written)], "bf16", WANT, regions=[(500, "the v heads")])
    assert "columns 500.. of every row, the v heads" in got


def test_results_that_change_between_launches_are_a_race():
    other = WANT.copy()
    other[2, 5] += 1.0
    got = diagnose([outcome(WANT), outcome(other), outcome(WANT)], "bf16", WANT)
    assert got.startswith("a race") and "__syncthreads" in got


def test_row_zero_right_and_the_rest_wrong_is_a_wrong_stride():
    got = WANT.copy()
    got[1:] = WANT.reshape(-1)[np.arange(1, 5)[:, None] + np.arange(577)[None, :]]   # row offset r, not r * H
    assert verdict(got).startswith("wrong stride")


def test_rows_in_the_wrong_place():
    assert verdict(WANT[[0, 2, 1, 3, 4]]).startswith("rows land in the wrong place: row 1 holds what belongs in row 2")


def test_a_known_mistaken_formula_is_named():
    wrong = WANT * 1.5
    got = diagnose([outcome(wrong)], "bf16", WANT, hints=[("the weight is missing", wrong)])
    assert got == "it looks like the weight is missing"


def test_computed_nan_is_not_mistaken_for_the_poison():
    got = WANT.copy()
    got[1] = np.nan                              # a 0/0: canonical NaN bits, not the poison's
    assert "NaN or inf (computed, not the poison)" in verdict(got)


def test_writes_where_nothing_belongs():
    want = np.full((6, 8), np.nan, np.float32)   # a cache: only rows 1 and 4 are written
    want[[1, 4]] = 1.0
    got = want.copy()
    got[2] = 1.0
    written = ~np.isnan(got)
    assert diagnose([outcome(np.nan_to_num(got), written=written)], "bf16", want).startswith("wrong destination")
    assert diagnose([outcome(np.nan_to_num(want), written=~np.isnan(want))], "bf16", want) is None


def test_failures_only_with_several_warps_are_a_race_between_warps():
    cases = [Case(f"{b} threads", (1,), b, {}, None, "bf16", WANT) for b in (32, 32, 256, 1024)]
    text = cuda_check._summarize([(cases[2], "wrong values: ..."), (cases[3], "wrong values: ...")], cases)
    assert text.startswith("a race between warps") and "__syncthreads()" in text
    assert cuda_check._summarize([(cases[0], "wrong values: x")], cases) == "case 32 threads: wrong values: x"


@pytest.mark.parametrize("name", list(CHECKERS))
def test_every_case_and_hint_is_distinguishable(name):
    """The reference passes every case; every hint is recognised when a kernel produces exactly it,
    and differs from the right answer in at least one case (so it can fire)."""
    exercise = _exercise(name)
    fires, texts = {}, set()
    for case in exercise.cases():
        written = ~np.isnan(case.want)
        assert diagnose([outcome(np.nan_to_num(case.want), case.out_dtype, written)], case.out_dtype, case.want,
                        exact=case.exact) is None, case.label
        for text, wrong in case.hints:
            texts.add(text)
            got = diagnose([outcome(np.nan_to_num(wrong), case.out_dtype, ~np.isnan(wrong))], case.out_dtype,
                           case.want, case.hints, exact=case.exact)
            if got is not None:
                fires[text] = fires.get(text, False) or got.startswith("it looks like")
    assert set(fires) == texts and all(fires.values()), fires


def _exercise(name):
    """The Exercise a checker builds, without running it (the checker is called with check_kernel stubbed)."""
    captured = {}
    real = cuda_check.check_kernel
    cuda_check.check_kernel = lambda exercise, source=None: captured.setdefault("e", exercise)
    try:
        CHECKERS[name]()
    finally:
        cuda_check.check_kernel = real
    return captured["e"]


def test_every_exercise_has_a_skeleton_and_a_solution():
    for name in CHECKERS:
        e = _exercise(name)
        text, shown = cuda_check.read_source(None, e)
        assert "TODO" in text and shown == f"kernels_cu/exercises/{name}.cu"
        solution = (cuda_check.SOLUTIONS_DIR / e.file).read_text()
        assert "TODO" not in solution and f"{e.kernel}(" in solution and f"{e.kernel}(" in text
    assert cuda_check.read_source("extern \"C\" __global__ void k() {}\n", e)[1] == f"your_{e.file}"
    with pytest.raises(FileNotFoundError):
        cuda_check.read_source("nowhere/missing.cu", e)


@pytest.mark.nogpu   # with a GPU the check runs for real
def test_without_a_gpu_or_a_cpu_executor_the_check_skips_and_shows_the_recorded_run(tmp_path, monkeypatch, capsys):
    from engine.exercises.cuda_cpu import executor as cuda_cpu
    monkeypatch.setattr(cuda_cpu, "unavailable_reason", lambda: "no host C++ compiler was found")
    run = {"device": "NVIDIA H200", "date": "2026-12-01", "copy_gbps": 4300.0,
           "checks": {"rmsnorm": "[OK] rmsnorm kernel: all 8 cases pass\n     speed on T=2047: yours 11.6 us\n"},
           "ladder": [{"kernel": "rmsnorm_naive (1 thread per row)", "shape": "T=2047 H=2048", "ms": 0.5,
                       "gbps": 50.0, "pct_of_copy": 1.2, "ok": True, "ladder": "rmsnorm"}]}
    path = tmp_path / "gpu_run.json"
    path.write_text(json.dumps(run))
    monkeypatch.setattr(recorded, "RECORDED", path)
    assert CHECKERS["rmsnorm"]() is None
    out = capsys.readouterr().out
    assert out.startswith("[skipped] rmsnorm kernel: needs a CUDA GPU")
    assert "Recorded run of the worked solution" in out and "NVIDIA H200, 2026-12-01" in out
    assert "| [OK] rmsnorm kernel: all 8 cases pass" in out
    assert "speed on T=2047: the worked solution 11.6 us" in out and "yours" not in out   # never "yours"
    assert CHECKERS["rope"]() is None
    assert "no recorded GPU run of this exercise" in capsys.readouterr().out
    recorded.show_ladder("rmsnorm")
    out = capsys.readouterr().out
    assert "recorded on NVIDIA H200, 2026-12-01" in out and "rmsnorm_naive (1 thread per row)" in out
    recorded.show_ladder("paged attention")
    assert "no recorded kernel ladder" in capsys.readouterr().out


def test_recorded_runs_of_the_worked_solutions_never_say_yours(capsys):
    """The recorded checks (and the recorder's wording) name the worked solution, not the learner."""
    assert recorded.as_worked_solution("speed on T=1: yours 8.1 us = 3 GB/s\nwith your kernel: 'Paris.'") == (
        "speed on T=1: the worked solution 8.1 us = 3 GB/s\nwith the worked solution's kernel: 'Paris.'")
    run = recorded.load()
    assert run is not None
    for name in CHECKERS:
        recorded.show_recorded(name)
        out = capsys.readouterr().out
        assert "Recorded run of the worked solution" in out and "the worked solution " in out, out
        assert not re.search(r"\byours?\b", out, re.I), out


# ----------------------------------------------------------------------------------------------
# On a GPU: the solutions pass, the skeletons are "not attempted", broken kernels get named
# ----------------------------------------------------------------------------------------------

def _solution(name):
    return (cuda_check.SOLUTIONS_DIR / f"{name}.cu").read_text()


@pytest.mark.parametrize("name", list(CHECKERS))
@pytest.mark.gpu
def test_gpu_solution_passes_its_checker(name, capsys):
    assert CHECKERS[name](cuda_check.SOLUTIONS_DIR / f"{name}.cu") is True, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.startswith("[OK]") and "GB/s" in out


@pytest.mark.parametrize("name", list(CHECKERS))
@pytest.mark.gpu
def test_gpu_skeleton_is_not_yet_written(name, capsys):
    assert CHECKERS[name]() is False
    assert "no output element was written" in capsys.readouterr().out


BROKEN = [
    ("rmsnorm", "    __syncthreads();                                              // every slot", "    //",
     "__syncthreads()"),
    ("rmsnorm", "x + (long long)blockIdx.x * H;", "x + (long long)blockIdx.x;", "wrong stride"),
    ("rmsnorm", "rsqrtf(total / H + eps)", "1.0f / (sqrtf(total / H) + eps)", "eps is added outside the square root"),
    ("embedding", "i += blockDim.x)", "i += H)", "only the first 128 of 577 columns"),
    ("embedding", "const long long row = ids[t];", "const long long row = t;", "instead of row ids[t]"),
    ("swiglu", "idx += stride)", "idx += n)", "never written"),
    ("swiglu", "idx < n; idx += stride)", "idx < n + 200; idx += n + 200)", "missing bounds check"),
    ("swiglu", "gate_up[t * 2 * I + I + i]", "gate_up[t * I + I + i]", "wrong stride"),
    ("rope", "(long long)positions[t]", "(long long)t", "not by its position"),
    ("rope", "out[vbase + j] = f2bf(qkv[vbase + j]);", ";", "the v heads"),
    ("kv_write", "(long long)slot_mapping[t] * kv_dim;", "(long long)t * kv_dim;", "wrong destination"),
    ("kv_write", "+ q_dim;   // skip the q heads", ";", "the q heads were copied"),
    ("paged_attention", "(long long)table[j / page_size] * page_size + j % page_size;",
     "(long long)seq_idx[r] * max_pages * page_size + j;", "the page table is ignored"),
]


@pytest.mark.parametrize("name,old,new,expected", BROKEN, ids=[f"{b[0]}-{b[3][:24]}" for b in BROKEN])
@pytest.mark.gpu
def test_gpu_broken_kernel_gets_the_right_diagnosis(name, old, new, expected, capsys):
    source = _solution(name)
    assert old in source, old
    assert CHECKERS[name](source.replace(old, new)) is False
    out = capsys.readouterr().out
    assert out.startswith("[x]") and expected in out, out
