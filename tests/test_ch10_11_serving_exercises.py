"""Chapters 10-11: the learner's scheduler and page allocator run engine.LLM; the whole-model checker."""
import numpy as np
import pytest
from helpers.exercises import verdict

from engine.exercises.ch10 import SchedulerSkeleton, check_scheduler
from engine.exercises.ch11 import PageAllocatorSkeleton, check_page_allocator
from engine.exercises.model_check import check_in_model
from engine.ops.paged_attention import paged_attention_ref
from engine.ops.rmsnorm import rmsnorm_ref
from engine.runtime.kv_allocator import AllocatorError, OutOfPages


class MyScheduler(SchedulerSkeleton):
    def admit_waiting(self):
        rows, tokens = [], 0
        while self.waiting:
            rid = self.waiting[0]
            request = self.request(rid)
            n = request.num_tokens
            if len(self.running) >= self.max_seqs:
                break
            if rows and tokens + n > self.max_batch_tokens:
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
        queue = list(self.running)          # oldest first
        scheduled, preempted = [], []
        while queue:
            rid = queue.pop(0)
            need = self.request(rid).num_tokens
            while not self.allocator.can_reserve(rid, need):
                victim = self.pick_victim(queue) if queue else rid
                self.preempt(victim)
                preempted.append(victim)
                if victim == rid:
                    break
            else:
                self.allocator.reserve(rid, need)
                scheduled.append(rid)
        return [self.decode_row(rid) for rid in scheduled], preempted

    def pick_victim(self, queue):
        """The newest running request not yet scheduled in this step."""
        return queue.pop()


class PreemptsTheOldest(MyScheduler):
    """The classic mistake: when memory runs out, evict the oldest other sequence, not the newest."""

    def pick_victim(self, queue):
        return queue.pop(0)


class MyAllocator(PageAllocatorSkeleton):
    def reserve(self, seq_id, new_len):
        if not self.can_reserve(seq_id, new_len):
            raise OutOfPages(f"sequence {seq_id} cannot grow to {new_len} tokens")
        is_new = seq_id not in self.tables
        table = self.tables.setdefault(seq_id, [])
        taken = []
        for _ in range(self.pages_needed(new_len) - len(table)):
            page = self.free_list.head                  # the oldest free page
            self.free_list.remove(page)
            self.refs[page] = 1
            taken.append(page)
        table.extend(taken)
        self.journal.append(("reserve", seq_id, taken, is_new))
        return taken

    def free(self, seq_id):
        if seq_id not in self.tables:
            raise AllocatorError(f"sequence {seq_id} holds no pages")
        table = self.tables.pop(seq_id)
        for page in reversed(table):                    # the last page first, to the tail
            self.refs[page] = 0
            self.free_list.append(page)
        self.journal.append(("free", seq_id, table))

    def rollback(self):
        while self.journal:
            record = self.journal.pop()                 # newest first
            if record[0] == "reserve":                  # the taken pages back to the HEAD, in order
                _, seq_id, taken, is_new = record
                for page in reversed(taken):
                    self.tables[seq_id].pop()
                    self.refs[page] = 0
                    self.free_list.insert_after(-1, page)
                if is_new:
                    del self.tables[seq_id]
            else:                                       # the freed pages off the tail, the table back
                _, seq_id, table = record
                for page in table:
                    self.free_list.remove(page)
                    self.refs[page] = 1
                self.tables[seq_id] = table


class FreesToTheWrongEnd(MyAllocator):
    """Freed pages go back at the head: the next reserve reuses them at once (the free queue order differs)."""

    def free(self, seq_id):
        if seq_id not in self.tables:
            raise AllocatorError(f"sequence {seq_id} holds no pages")
        table = self.tables.pop(seq_id)
        for page in table:
            self.refs[page] = 0
            self.free_list.insert_after(-1, page)
        self.journal.append(("free", seq_id, table))


def test_scheduler_exercise(capsys):
    assert check_scheduler(MyScheduler) is True
    assert "the same tokens" in verdict(capsys)
    assert check_scheduler(SchedulerSkeleton) is False
    assert verdict(capsys).startswith("[ ]")
    assert check_scheduler(PreemptsTheOldest) is False
    out = capsys.readouterr().out
    assert "step 9 differs first" in out and "preempted [3]" in out


def test_page_allocator_exercise(capsys):
    assert check_page_allocator(MyAllocator) is True
    assert "the same tokens" in verdict(capsys)
    assert check_page_allocator(PageAllocatorSkeleton) is False
    assert verdict(capsys).startswith("[ ]")
    assert check_page_allocator(FreesToTheWrongEnd) is False
    assert "operation 4, free(1)" in capsys.readouterr().out


def test_the_scheduler_skeleton_refuses_static_batching():
    from engine.runtime.kv_allocator import PageAllocator
    with pytest.raises(ValueError, match="continuous"):
        MyScheduler(PageAllocator(4, 4), 2, 10, 20, policy="static")


@pytest.mark.slow
def test_whole_model_checker_passes_the_engine_and_names_the_first_divergence(default_model_dir, capsys):
    assert check_in_model({"rmsnorm": rmsnorm_ref}, max_new_tokens=4, model_dir=str(default_model_dir))
    assert capsys.readouterr().out.startswith("[OK]")

    def eps_outside(x, w, eps):
        return x / (np.sqrt(np.mean(x * x, -1, keepdims=True)) + np.float32(eps)) * w
    report = check_in_model({"rmsnorm": eps_outside}, max_new_tokens=4, model_dir=str(default_model_dir))
    assert not report and report.stage == "rmsnorm" and report.layer == "layer 0 (input norm)"
    assert report.position == 0

    def off_by_one(q, k_cache, v_cache, tables, seq_idx, positions, scale):
        return paged_attention_ref(q, k_cache, v_cache, tables, seq_idx, np.asarray(positions) - 1, scale)
    report = check_in_model({"paged_attention": off_by_one}, max_new_tokens=4, model_dir=str(default_model_dir))
    assert not report and report.stage == "paged_attention" and report.layer == "layer 0"
    assert "decode step 1" in capsys.readouterr().out


def test_whole_model_checker_reports_an_unwritten_stage(default_model_dir, capsys):
    def unwritten(gate_up):
        raise NotImplementedError
    assert not check_in_model({"swiglu": unwritten}, max_new_tokens=2, model_dir=str(default_model_dir))
    assert verdict(capsys).startswith("[ ]")
