"""Pictures of serving (chapters 09-11), drawn from the scheduler's step log and snapshot().

Every function takes plain data (a step log, see engine/runtime/step_log.py: `llm.last_step_log` or
`sched.step_log`; a snapshot: `sched.snapshot()`), draws on a matplotlib Axes (a new figure when `ax`
is None) and returns the Axes:

    gantt(log)                    one row per request, one bar per run of steps in the same state
    occupancy(log, max_seqs)      rows in each batch (and static batching's idle seats), queue length
    memory(log, page_size)       KV cache reserved vs holding real tokens; the gap is waste
    page_table(snapshot)          the pool of pages: who owns each page, how full it is, page tables

The numbers behind them (summarize, request_timelines, request_latencies) live in engine/runtime/step_log.py.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from engine.runtime.step_log import STATES, request_timelines, x_edges

STATE_STYLE = {                      # (face colour, hatch)
    "waiting": ("#e6e6e6", ""),
    "prefill": ("#d95f02", ""),
    "decode": ("#1b9e77", ""),
    "stalled": ("#a6dba0", "...."),
    "idle": ("#ffffff", "////"),
}


def request_color(request_id: int):
    return plt.get_cmap("tab20")(request_id % 20)


def _axes(ax, figsize):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def _runs(states: list[str]):
    """(state, first step, length) of every maximal run of one non-empty state."""
    runs, start = [], 0
    for s in range(1, len(states) + 1):
        if s == len(states) or states[s] != states[start]:
            if states[start]:
                runs.append((states[start], start, s - start))
            start = s
    return runs


def gantt(step_log, ax=None, title: str | None = None, x: str = "step",
          cancelled: dict[int, int] | None = None):
    """One row per request (id 0 on top), one bar per run of steps in the same state.

    Preemptions are marked with a red x at the step they happened. x="seconds" stretches every step
    to its wall time.
    """
    timelines = request_timelines(step_log, cancelled)
    ax = _axes(ax, (10, 0.35 * len(timelines) + 1.2))
    edges = x_edges(step_log, x)
    used = set()
    for rid, states in timelines.items():
        for state, start, length in _runs(states):
            color, hatch = STATE_STYLE[state]
            ax.barh(rid, edges[start + length] - edges[start], left=edges[start], height=0.7,
                    color=color, hatch=hatch, edgecolor="0.35", linewidth=0.4)
            used.add(state)
    marks = [(edges[s], rid) for s, e in enumerate(step_log) for rid in e["preempted"]]
    if marks:
        ax.scatter(*zip(*marks, strict=True), marker="x", color="red", s=40, zorder=3, label="preempted")
    handles = [Patch(facecolor=STATE_STYLE[s][0], hatch=STATE_STYLE[s][1], edgecolor="0.35", label=s)
               for s in STATES if s in used]
    if marks:
        handles.append(ax.collections[-1])
    ax.set_yticks(sorted(timelines))
    ax.set_ylim(max(timelines, default=0) + 0.8, -1.2)
    return _finish(ax, handles, edges, x, "request", title)


def _finish(ax, handles, edges, x: str, ylabel: str, title: str | None):
    """The legend above the plot, the x range of the steps, the axis labels and the title."""
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              ncol=len(handles), frameon=False)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel("step" if x == "step" else "seconds")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    return ax


def occupancy(step_log, max_seqs: int | None = None, ax=None, title: str | None = None,
              x: str = "step"):
    """Bars per step, stacked: the batch's decode rows, its prefill rows, and the idle seats
    of static batching (hatched, height 0 when none); a line of the waiting queue; a dashed line at
    max_seqs when given."""
    ax = _axes(ax, (10, 2.8))
    edges = x_edges(step_log, x)
    left, width = edges[:-1], np.diff(edges)
    rows = np.array([e["rows"] for e in step_log])
    prefill = np.array([len(e["prefill_ids"]) for e in step_log])   # chunked prefill mixes both kinds
    idle = np.array([e["idle_slots"] for e in step_log])
    ax.bar(left, rows - prefill, width=width, align="edge", color=STATE_STYLE["decode"][0], edgecolor="none")
    ax.bar(left, prefill, width=width, bottom=rows - prefill, align="edge", color=STATE_STYLE["prefill"][0],
           edgecolor="none")
    ax.bar(left, idle, width=width, bottom=rows, align="edge", color="white", hatch="////",
           edgecolor="0.5", linewidth=0)
    ax.step(edges, np.append([e["waiting"] for e in step_log], step_log[-1]["waiting"] if step_log else 0),
            where="post", color="0.2", lw=1, label="waiting")
    if max_seqs is not None:
        ax.axhline(max_seqs, color="k", ls="--", lw=0.8, label=f"max_seqs = {max_seqs}")
    handles = [Patch(color=STATE_STYLE["prefill"][0], label="prefill rows"),
               Patch(color=STATE_STYLE["decode"][0], label="decode rows"),
               Patch(facecolor="white", hatch="////", edgecolor="0.5", label="idle seats"),
               *ax.get_lines()]
    return _finish(ax, handles, edges, x, "sequences", title)


def memory(step_log, page_size: int, ax=None, label: str = "", x: str = "step",
           show_cached: bool = True, color=None):
    """KV memory per step, in token positions: reserved (used_pages * page_size, a line) and
    holding real K/V (cached_tokens, a second line when show_cached), the waste between them shaded."""
    ax = _axes(ax, (10, 2.8))
    mid = x_edges(step_log, x)[1:]                   # the state after each step
    reserved = np.array([e["used_pages"] * page_size for e in step_log])
    cached = np.array([e["cached_tokens"] for e in step_log])
    prefix = f"{label}: " if label else ""
    line, = ax.plot(mid, reserved, drawstyle="steps-pre", color=color, lw=1.5,
                    label=f"{prefix}reserved ({page_size}-token pages)")
    ax.fill_between(mid, cached, reserved, step="pre", color=line.get_color(), alpha=0.15)
    if show_cached:
        ax.plot(mid, cached, drawstyle="steps-pre", color="k", lw=1, label="tokens actually cached")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_xlabel("step" if x == "step" else "seconds")
    ax.set_ylabel("token positions")
    return ax


def page_table(snapshot: dict, ax=None, cols: int = 16, title: str | None = None):
    """The pool as a grid of pages (between steps). Each page: a frame (all num_pages of them),
    plus, when owned, a fill bar in its request's colour as wide as the tokens it holds, labelled
    r<request>.<index in its page table>. Running requests hold num_tokens - 1 cached tokens (the
    last sampled token is written by the next step). The page tables are listed below the grid."""
    if snapshot["in_flight"] is not None:
        raise ValueError("page_table draws the pool between steps; this snapshot has a batch in flight")
    n, bs = snapshot["num_pages"], snapshot["page_size"]
    owner = {}
    for rid, table in snapshot["page_tables"].items():
        cached = snapshot["num_tokens"][rid] - 1
        for i, page in enumerate(table):
            owner[page] = (rid, i, min(bs, max(0, cached - i * bs)))
    rows = -(-n // cols)
    lines = [f"r{rid}: pages {table}  ({snapshot['num_tokens'][rid] - 1} tokens cached)"
             for rid, table in snapshot["page_tables"].items()] or ["(no running request)"]
    text_top = -(rows - 1) - 0.25                      # just below the last row of pages
    bottom = text_top - 0.22 * len(lines) - 0.2
    ax = _axes(ax, (min(cols, n) * 0.7 + 0.5, 0.55 * (1.0 - bottom) + 0.6))
    for page in range(n):
        r, c = divmod(page, cols)
        ax.add_patch(Rectangle((c, -r), 0.95, 0.9, facecolor="white", edgecolor="0.6", lw=0.6))
        ax.text(c + 0.05, -r + 0.8, str(page), fontsize=5, color="0.4", va="top")
        if page in owner:
            rid, i, used = owner[page]
            ax.add_patch(Rectangle((c, -r), 0.95 * used / bs, 0.6, facecolor=request_color(rid), alpha=0.9))
            ax.text(c + 0.47, -r + 0.3, f"r{rid}.{i}", fontsize=6, ha="center", va="center")
    ax.text(0, text_top, "\n".join(lines), fontsize=7, va="top", family="monospace")
    ax.set_xlim(-0.1, min(cols, n))
    ax.set_ylim(bottom, 1.0)
    ax.set_axis_off()
    free = snapshot["free_pages"]
    ax.set_title(title or f"pool of {n} pages x {bs} tokens: {n - free} used, {free} free", fontsize=9)
    return ax
