"""engine.exercises.plots on step logs of the real scheduler (driven with a stand-in model): the per-step states
agree with the scheduler's own counts, and every figure has the bars and lines it promises."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st

from engine.exercises import plots
from engine.exercises.ch09 import STAND_IN_TOKEN, run_scheduler  # noqa: E402
from engine.exercises.ch10 import HAND_WORKLOAD  # noqa: E402
from engine.runtime import step_log
from engine.runtime.kv_allocator import PageAllocator  # noqa: E402
from engine.runtime.sampling_params import SamplingParams  # noqa: E402
from engine.runtime.scheduler import Scheduler  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def hand_log(policy):
    return run_scheduler(**HAND_WORKLOAD, policy=policy)


def test_timelines_of_the_hand_workload():
    # continuous: 0+1 prefill (1 finishes), 2+3 prefill (0 stalls), decode all, 4 arrives, ...
    assert step_log.request_timelines(hand_log("continuous")) == {
        0: ["prefill", "stalled", "decode", "stalled", "decode"],
        1: ["prefill", "", "", "", ""],
        2: ["waiting", "prefill", "decode", "", ""],
        3: ["waiting", "prefill", "decode", "", ""],
        4: ["", "", "", "prefill", "decode"]}
    # static: 1's seat stays idle until the group {0, 1, 2} ends; 3 waits for the next group
    assert step_log.request_timelines(hand_log("static")) == {
        0: ["prefill", "stalled", "decode", "decode", "", ""],
        1: ["prefill", "idle", "idle", "idle", "", ""],
        2: ["waiting", "prefill", "decode", "idle", "", ""],
        3: ["waiting", "waiting", "waiting", "waiting", "prefill", "decode"],
        4: ["", "", "", "waiting", "prefill", "decode"]}


def test_latencies_and_summary_of_the_hand_workload():
    log = hand_log("continuous")
    assert step_log.request_latencies(log) == {0: (1, 5), 1: (1, 1), 2: (2, 3), 3: (2, 3), 4: (1, 2)}
    summary = step_log.summarize(log)
    assert summary["output_tokens"] == sum(HAND_WORKLOAD["max_new"])
    assert (summary["steps"], summary["prefill_steps"], summary["decode_steps"]) == (5, 3, 2)
    assert summary["mean_decode_rows"] == 2.5 and "seconds" not in summary
    assert step_log.summarize(hand_log("static"))["idle_slot_steps"] == 1 + 1 + 2


def check_states_against_counts(log):
    timelines = step_log.request_timelines(log)
    for s, entry in enumerate(log):
        column = [states[s] for states in timelines.values()]
        assert column.count("waiting") == entry["waiting"]
        assert sum(c in ("prefill", "decode", "stalled") for c in column) == entry["running"]
        assert column.count("idle") == entry["idle_slots"]
        assert sorted(r for r, states in timelines.items() if states[s] == entry["kind"]) == \
            sorted(entry["request_ids"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=10),
       st.integers(1, 4), st.sampled_from(["static", "continuous"]), st.booleans())
def test_states_agree_with_the_scheduler_counts(requests, max_seqs, policy, tight_pool):
    prompts, max_new, gaps = zip(*requests)
    arrivals = [sum(gaps[:i + 1]) for i in range(len(gaps))]
    # a pool of just enough 4-token pages for the largest request: waiting and preemptions
    allocator = PageAllocator(max(-(-(p + n) // 4) for p, n in zip(prompts, max_new)), 4) if tight_pool else None
    log = run_scheduler(list(prompts), list(max_new), policy=policy, max_seqs=max_seqs, arrivals=arrivals,
                        allocator=allocator, admission="on_demand" if tight_pool else "conservative")
    check_states_against_counts(log)


def test_gantt_has_one_bar_per_run_and_marks_preemptions():
    # two requests that cannot both grow in a 3-page pool: the newest is preempted
    log = run_scheduler([4, 4], [8, 8], policy="continuous", max_seqs=2,
                        allocator=PageAllocator(3, 4), admission="on_demand")
    preemptions = sum(len(e["preempted"]) for e in log)
    assert preemptions >= 1
    check_states_against_counts(log)
    ax = plots.gantt(log, title="tight pool")
    runs = sum(len(plots._runs(states)) for states in step_log.request_timelines(log).values())
    assert len(ax.patches) == runs
    assert len(ax.collections) == 1 and len(ax.collections[0].get_offsets()) == preemptions
    assert ax.get_title(loc="left") == "tight pool"


def test_occupancy_memory_bars_and_lines():
    log = hand_log("static")
    ax = plots.occupancy(log, max_seqs=3)
    assert len(ax.patches) == 3 * len(log)                    # decode rows + prefill rows + idle seats
    heights = [bar.get_height() for bar in ax.patches]
    n = len(log)
    assert [d + p for d, p in zip(heights[:n], heights[n:2 * n])] == [e["rows"] for e in log]
    assert heights[n:2 * n] == [e["rows"] if e["kind"] == "prefill" else 0 for e in log]
    assert heights[2 * n:] == [e["idle_slots"] for e in log]
    assert len(ax.get_lines()) == 2                          # waiting queue, max_seqs
    assert len(plots.occupancy(log).get_lines()) == 1
    ax = plots.memory(log, page_size=20, label="slots")
    assert len(ax.get_lines()) == 2
    assert list(ax.get_lines()[0].get_ydata()) == [e["used_pages"] * 20 for e in log]
    assert list(ax.get_lines()[1].get_ydata()) == [e["cached_tokens"] for e in log]
    assert len(plots.memory(log, 20, show_cached=False).get_lines()) == 1


def test_seconds_axis():
    log = hand_log("continuous")
    with pytest.raises(ValueError, match="seconds"):
        plots.gantt(log, x="seconds")
    with pytest.raises(ValueError, match="'step' or 'seconds'"):
        plots.occupancy(log, x="time")
    timed = [dict(e, seconds=0.5) for e in log]
    assert plots.gantt(timed, x="seconds").get_xlim() == (0.0, 2.5)
    assert step_log.request_latencies(timed, x="seconds")[0] == (0.5, 2.5)
    assert step_log.summarize(timed)["tokens_per_second"] == sum(HAND_WORKLOAD["max_new"]) / 2.5


def test_cancelled_rows_end_at_the_cancel():
    sched = Scheduler(PageAllocator(8, 4), 2, 64, 32, policy="continuous")
    a = sched.submit([STAND_IN_TOKEN] * 3, SamplingParams(max_new_tokens=6, ignore_eos=True))
    b = sched.submit([STAND_IN_TOKEN] * 3, SamplingParams(max_new_tokens=6, ignore_eos=True))
    for _ in range(2):
        batch = sched.schedule()
        sched.complete(batch.batch_id, [STAND_IN_TOKEN] * len(batch.rows))
    cancelled = {b: len(sched.step_log)}
    sched.cancel(b)
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.complete(batch.batch_id, [STAND_IN_TOKEN] * len(batch.rows))
    timelines = step_log.request_timelines(sched.step_log, cancelled)
    assert timelines[b] == ["prefill", "decode", "", "", "", ""]
    assert timelines[a] == ["prefill", "decode", "decode", "decode", "decode", "decode"]


def test_page_table_draws_every_page_and_the_owned_fill():
    sched = Scheduler(PageAllocator(10, 4), 3, 64, 64, policy="continuous")
    for n in (6, 3, 9):
        sched.submit([STAND_IN_TOKEN] * n, SamplingParams(max_new_tokens=5, ignore_eos=True))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="in flight"):
        plots.page_table(sched.snapshot())
    sched.complete(batch.batch_id, [STAND_IN_TOKEN] * len(batch.rows))
    snap = sched.snapshot()
    ax = plots.page_table(snap, cols=5)
    assert len(ax.patches) == snap["num_pages"] + snap["used_pages"]
    fills = sorted(round(p.get_width() / 0.95 * 4) for p in ax.patches if p.get_height() == 0.6)
    # prompts of 6, 3, 9 tokens in 4-token pages: 4+2, 3, 4+4+1
    assert fills == sorted([4, 2, 3, 4, 4, 1])
