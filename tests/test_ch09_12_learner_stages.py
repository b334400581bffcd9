"""The stages the learner builds in chapters 09, 10 and 12: the static batcher (through the real model),
the scheduler checker's no-progress verdicts, and the incremental detokenizer (in the chat). Each
checker accepts a solution written from the chapter's rules, rejects the classic mistakes with a
verdict that names them, and returns a verdict within bounded work for a loop that never finishes."""
from __future__ import annotations

from collections import deque

import pytest
from helpers.exercises import accepts, not_attempted, rejects, verdict
from helpers.work import call_budget

import engine
from engine.exercises import ch09, ch10, ch12, serving_check
from engine.exercises.ch08 import tiny_model
from engine.exercises.ch09 import PAD
from engine.runtime.scheduler import Scheduler

# ----------------------------------------------------------------------------- chapter 09: the static batcher


def static_batcher(runner, prompts, max_new, batch_size):
    outputs = [[] for _ in prompts]
    for start in range(0, len(prompts), batch_size):
        group = list(range(start, min(start + batch_size, len(prompts))))
        last = runner.prefill([prompts[i] for i in group])
        for i, t in zip(group, last):
            outputs[i].append(t)
        while any(len(outputs[i]) < max_new[i] for i in group):
            feed = [last[s] if len(outputs[i]) < max_new[i] else runner.PAD for s, i in enumerate(group)]
            last = runner.decode(feed)
            for s, i in enumerate(group):
                if feed[s] != runner.PAD:
                    outputs[i].append(last[s])
    return outputs


def admits_mid_batch(runner, prompts, max_new, batch_size):
    """Refills a seat as soon as it frees up (continuous batching with the static runner)."""
    outputs = [[] for _ in prompts]
    group = list(range(min(batch_size, len(prompts))))
    last = dict(zip(group, runner.prefill([prompts[i] for i in group])))
    for i in group:
        outputs[i].append(last[i])
    nxt = len(group)
    while any(len(outputs[i]) < max_new[i] for i in group) or nxt < len(prompts):
        done = [i for i in group if len(outputs[i]) >= max_new[i]]
        if done and nxt < len(prompts):
            group = [i for i in group if i not in done] + [nxt]
            last[nxt] = runner.prefill([prompts[nxt]])[0]
            outputs[nxt].append(last[nxt])
            nxt += 1
            continue
        feed = [last[i] if len(outputs[i]) < max_new[i] else PAD for i in group]
        for i, t in zip(group, runner.decode(feed)):
            if t != PAD:
                outputs[i].append(t)
                last[i] = t
    return outputs


def drops_finished_rows(runner, prompts, max_new, batch_size):
    outputs = [[] for _ in prompts]
    for start in range(0, len(prompts), batch_size):
        group = list(range(start, min(start + batch_size, len(prompts))))
        last = dict(zip(group, runner.prefill([prompts[i] for i in group])))
        for i in group:
            outputs[i].append(last[i])
        while live := [i for i in group if len(outputs[i]) < max_new[i]]:
            for i, t in zip(live, runner.decode([last[i] for i in live])):
                outputs[i].append(t)
                last[i] = t
    return outputs


def keeps_padding_tokens(runner, prompts, max_new, batch_size):
    outputs = [[] for _ in prompts]
    for start in range(0, len(prompts), batch_size):
        group = list(range(start, min(start + batch_size, len(prompts))))
        last = runner.prefill([prompts[i] for i in group])
        for i, t in zip(group, last):
            outputs[i].append(t)
        for _ in range(max(max_new[i] for i in group) - 1):
            feed = [last[s] if len(outputs[i]) < max_new[i] else PAD for s, i in enumerate(group)]
            last = runner.decode(feed)
            for s, i in enumerate(group):
                outputs[i].append(last[s])          # a padded seat's PAD too
    return outputs


def one_decode_too_many(runner, prompts, max_new, batch_size):
    outputs = [[] for _ in prompts]
    for start in range(0, len(prompts), batch_size):
        group = list(range(start, min(start + batch_size, len(prompts))))
        last = runner.prefill([prompts[i] for i in group])
        for i, t in zip(group, last):
            outputs[i].append(t)
        for _ in range(max(max_new[i] for i in group)):   # the prefill's token forgotten
            feed = [last[s] if len(outputs[i]) < max_new[i] else PAD for s, i in enumerate(group)]
            last = runner.decode(feed)
            for s, i in enumerate(group):
                if feed[s] != PAD:
                    outputs[i].append(last[s])
    return outputs


def one_short(runner, prompts, max_new, batch_size):
    return [out[1:] for out in static_batcher(runner, prompts, max_new, batch_size)]   # drops the prefill's token


def skips_partial_group(runner, prompts, max_new, batch_size):
    n = len(prompts) - len(prompts) % batch_size
    return static_batcher(runner, prompts[:n], max_new[:n], batch_size) + [[] for _ in prompts[n:]]


def never_finishes(runner, prompts, max_new, batch_size):
    """Decodes forever and swallows every error: the runner must still stop it."""
    last = runner.prefill(prompts[:batch_size])
    while True:
        try:
            last = runner.decode(last)
        except Exception:
            pass


def test_ch09_static_batcher(capsys):
    accepts(ch09.check_static_batcher, static_batcher, capsys)
    rejects(ch09.check_static_batcher, admits_mid_batch, capsys, "while request(s) [0] of the current group")
    rejects(ch09.check_static_batcher, drops_finished_rows, capsys, "pass PAD for its row rather than leaving it out")
    rejects(ch09.check_static_batcher, keeps_padding_tokens, capsys, "holds PAD")
    rejects(ch09.check_static_batcher, one_decode_too_many, capsys, "off by one")
    rejects(ch09.check_static_batcher, one_short, capsys, "one short")
    rejects(ch09.check_static_batcher, skips_partial_group, capsys, "the last, partial group was left out")
    rejects(ch09.check_static_batcher, lambda r, p, m, b: [[1] * n for n in m], capsys, "never ran")
    assert ch09.check_static_batcher(not_attempted) is False and verdict(capsys).startswith("[ ]")


def test_ch09_static_batcher_stops_a_loop_without_end(capsys):
    with call_budget(2_000_000):
        assert ch09.check_static_batcher(never_finishes) is False
    line = verdict(capsys)
    assert line.startswith("[x]") and "already had its" in line, line


def test_ch09_runner_step_cap():
    runner = ch09.StaticBatchRunner(tiny_model("tiny"), [[5, 6, 7]], [50], seats=1, max_steps=4)
    last = runner.prefill([[5, 6, 7]])
    with pytest.raises(BaseException, match="no end after 4 steps"):
        for _ in range(10):
            last = runner.decode(last)
    assert len(runner.trace) == 4


@pytest.mark.slow
def test_ch09_static_batcher_in_model(capsys):
    assert ch09.check_static_batcher_in_model(static_batcher) is True
    out = capsys.readouterr().out
    assert "[OK] static batcher in the model" in out and "Paris" in out
    assert ch09.check_static_batcher_in_model(admits_mid_batch) is False
    assert "continuous batching, chapter 10" in verdict(capsys)


# ----------------------------------------------------------------------------- chapters 09-10: no progress

class MyScheduler(ch10.SchedulerSkeleton):
    def admit_waiting(self):
        rows, tokens = [], 0
        while self.waiting:
            rid = self.waiting[0]
            request = self.request(rid)
            n = request.num_tokens
            if len(self.running) >= self.max_seqs or (rows and tokens + n > self.max_batch_tokens):
                break
            if not self.allocator.can_reserve(rid, n):
                break
            if self.admission == "conservative" and \
                    self.promised_blocks() + request.worst_pages > self.allocator.num_pages:
                break
            rows.append(self.admit(rid))
            tokens += n
        return rows

    def decode_running(self):
        queue, scheduled, preempted = deque(self.running), [], []
        while queue:
            rid = queue.popleft()
            need = self.request(rid).num_tokens
            while not self.allocator.can_reserve(rid, need):
                victim = queue.pop() if queue else rid
                self.preempt(victim)
                preempted.append(victim)
                if victim == rid:
                    break
            else:
                self.allocator.reserve(rid, need)
                scheduled.append(rid)
        return [self.decode_row(rid) for rid in scheduled], preempted


class NeverPreempts(MyScheduler):
    """Decodes whoever fits and leaves the rest waiting for pages that never come back."""

    def decode_running(self):
        scheduled = []
        for rid in self.running:
            need = self.request(rid).num_tokens
            if self.allocator.can_reserve(rid, need):
                self.allocator.reserve(rid, need)
                scheduled.append(rid)
        return [self.decode_row(rid) for rid in scheduled], []


def test_ch10_scheduler_that_never_preempts_gets_a_verdict(capsys):
    with call_budget(3_000_000):
        assert ch10.check_scheduler(NeverPreempts) is False
    line = verdict(capsys)
    assert line.startswith("[x]") and "makes no progress" in line and "preempted" in line, line


def test_ch10_scheduler_checker_still_accepts(capsys):
    assert ch10.check_scheduler(MyScheduler) is True
    assert verdict(capsys).startswith("[OK]")


def test_run_scheduler_step_cap():
    with pytest.raises(ch09.NoProgress, match="without finishing"):
        ch09.run_scheduler([4, 4], [30, 30], policy="continuous", max_seqs=2, max_steps=5)
    with pytest.raises(ch09.NoProgress, match="returned no batch"):
        from engine.runtime.kv_allocator import PageAllocator
        ch09.run_scheduler([8, 8], [20, 20], policy="continuous", max_seqs=2, admission="on_demand",
                           allocator=PageAllocator(8, 4), scheduler_cls=NeverPreempts)
    assert len(ch09.run_scheduler([4, 4], [30, 30], policy="continuous", max_seqs=2)) == 30


def test_step_capped_engine_llm_stops(capsys):
    prompts, params = ch10._tiny_requests()
    llm = engine.LLM(serving_check.tiny_model_dir(), backend="numpy", kv_cache_mib=0.05, max_seqs=4,
                     max_context=256, chunked_prefill=False,
                     scheduler_cls=serving_check.step_capped(Scheduler, 6))
    with pytest.raises(serving_check.StepCapReached, match="6 steps ran"):
        llm.generate(prompts, params)


# ----------------------------------------------------------------------------- chapter 12: the detokenizer

def incomplete_tail(buf: bytes) -> int:
    """Bytes at the end of buf that begin a UTF-8 character not complete yet."""
    for back in range(1, min(3, len(buf)) + 1):
        b = buf[-back]
        if b & 0xC0 == 0x80:
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return back if need > back else 0
    return 0


class Detokenizer:
    def __init__(self, tokenizer, skip_special_tokens=False):
        self.tok, self.skip, self.pending = tokenizer, skip_special_tokens, b""

    def push(self, token_id):
        self.pending += self.tok.token_bytes([token_id], self.skip)
        cut = len(self.pending) - incomplete_tail(self.pending)
        text, self.pending = self.pending[:cut].decode("utf-8", errors="replace"), self.pending[cut:]
        return text

    def flush(self):
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text


class EachTokenAlone(Detokenizer):
    def push(self, token_id):
        return self.tok.token_bytes([token_id], self.skip).decode("utf-8", errors="replace")


class NoFlush(Detokenizer):
    def flush(self):
        return ""


class WholeTextEachTime(Detokenizer):
    def __init__(self, *args):
        super().__init__(*args)
        self.ids = []

    def push(self, token_id):
        self.ids.append(token_id)
        return self.tok.decode(self.ids, skip_special_tokens=self.skip)


class FlushRepeats(Detokenizer):
    def __init__(self, *args):
        super().__init__(*args)
        self.out = ""

    def push(self, token_id):
        piece = super().push(token_id)
        self.out += piece
        return piece

    def flush(self):
        return self.out + super().flush()


class HoldsUntilTheEnd(Detokenizer):
    def push(self, token_id):
        self.pending += self.tok.token_bytes([token_id], self.skip)
        return ""


class IgnoresSkip(Detokenizer):
    def __init__(self, tokenizer, skip_special_tokens=False):
        super().__init__(tokenizer, False)


@pytest.mark.slow
def test_ch12_detokenizer(capsys):
    accepts(ch12.check_detokenizer, Detokenizer, capsys)
    accepts(ch12.check_detokenizer, engine.text.tokenizer.IncrementalDetokenizer, capsys)
    rejects(ch12.check_detokenizer, EachTokenAlone, capsys, "part of a multi-byte character")
    rejects(ch12.check_detokenizer, NoFlush, capsys, "the final flush lost the held-back text")
    rejects(ch12.check_detokenizer, WholeTextEachTime, capsys, "already emitted")
    rejects(ch12.check_detokenizer, FlushRepeats, capsys, "flush() re-emitted text")
    rejects(ch12.check_detokenizer, HoldsUntilTheEnd, capsys, "goes out at once")
    rejects(ch12.check_detokenizer, IgnoresSkip, capsys, "special token")
    assert ch12.check_detokenizer(type("Todo", (), {"__init__": lambda s, *a: None, "push": not_attempted,
                                                    "flush": not_attempted})) is False
    assert verdict(capsys).startswith("[ ]")


@pytest.mark.slow
def test_ch12_detokenizer_in_chat(capsys):
    tok = engine.load_tokenizer(engine.ensure_default_model())
    own = tok.detokenizer
    assert ch12.check_detokenizer_in_chat(Detokenizer) is True
    out = capsys.readouterr().out
    assert "[OK] detokenizer in the chat" in out and "🌟" in out
    assert ch12.check_detokenizer_in_chat(EachTokenAlone) is False
    assert "piece" in verdict(capsys)
    assert tok.detokenizer == own                   # nothing left patched on a fresh tokenizer either


def test_use_detokenizer_restores_the_tokenizer():
    tok = engine.load_tokenizer(engine.ensure_default_model())
    with ch12.use_detokenizer(tok, EachTokenAlone):
        assert isinstance(tok.detokenizer(True), EachTokenAlone)
    assert isinstance(tok.detokenizer(True), engine.text.tokenizer.IncrementalDetokenizer)
