"""engine.runtime.engine_process: the engine in a child process behind RemoteLLM (what `python -m engine.serve`
runs). Same tokens as LLM.generate, refusals as ValueError, a dead engine fails its requests."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine.runtime.engine_process import EngineProcessError, RemoteLLM
from engine.runtime.llm import LLM
from engine.runtime.sampling_params import SamplingParams

OPTIONS = {"kv_cache_mib": 0.5, "max_context": 256, "max_seqs": 8}


@pytest.fixture(scope="module")
def model_dir(tiny_chat_dir):
    return tiny_chat_dir


@pytest.fixture(scope="module")
def remote(model_dir):
    with RemoteLLM(model_dir, "numpy", **OPTIONS) as llm:
        yield llm


@pytest.mark.slow
def test_streams_the_tokens_llm_generate_makes(remote, model_dir):
    prompts = ["The KV cache", "Pages of sixteen tokens", "a"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 17, 1)]
    reference = LLM(model_dir, "numpy", **OPTIONS).generate(prompts, params)
    handles = [remote.submit(p, sp) for p, sp in zip(prompts, params)]
    for handle, ref in zip(handles, reference):
        events = list(handle.stream())
        assert [t for e in events for t in e.token_ids] == ref.token_ids
        assert "".join(e.text for e in events) == ref.text
        assert events[-1].finished and events[-1].finish_reason == "length"
        out = handle.result(timeout=30)
        assert (out.token_ids, out.text, out.prompt_token_ids) == (ref.token_ids, ref.text, ref.prompt_token_ids)


def test_a_refused_request_raises_value_error_on_accepted(remote):
    handle = remote.submit([5] * 300, SamplingParams(max_new_tokens=4))     # longer than max_context
    with pytest.raises(ValueError, match="context"):
        asyncio.run(handle.accepted())
    assert handle.done
    with pytest.raises(ValueError, match="context"):
        handle.result(timeout=10)
    ok = remote.submit([5, 6, 7], SamplingParams(max_new_tokens=2))
    asyncio.run(ok.accepted())
    assert len(ok.result(timeout=30).token_ids) == 2


def test_cancel_frees_the_pages_in_the_engine_process(remote):
    handle = remote.submit("a long answer", SamplingParams(max_new_tokens=200, ignore_eos=True))
    next(iter(handle.stream()))
    handle.cancel()
    assert handle.result(timeout=30).finish_reason == "cancelled"
    stats = remote.stats()
    assert (stats["running"], stats["waiting"], stats["pages_used"]) == (0, 0, 0)


def test_astream_batches_cover_every_token(remote):
    async def run():
        handle = remote.submit("count with me", SamplingParams(max_new_tokens=30, ignore_eos=True))
        await handle.accepted()
        return [event async for batch in handle.astream_batches() for event in batch]
    events = asyncio.run(run())
    assert sum(len(e.token_ids) for e in events) == 30 and events[-1].finished


def test_a_bad_model_directory_fails_at_start(tmp_path):
    with pytest.raises((ValueError, EngineProcessError, OSError)):
        RemoteLLM(tmp_path / "no-such-model", "numpy")


@pytest.mark.slow
def test_a_dead_engine_process_fails_its_requests(model_dir):
    llm = RemoteLLM(model_dir, "numpy", **OPTIONS)
    try:
        handle = llm.submit("never ending", SamplingParams(max_new_tokens=200, ignore_eos=True))
        next(iter(handle.stream()))
        os.kill(llm._process.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError):
            handle.result(timeout=30)
        with pytest.raises((RuntimeError, EngineProcessError)):
            llm.submit("after", SamplingParams(max_new_tokens=2))
    finally:
        llm.close()


def test_a_submit_that_cannot_be_sent_leaves_nothing_behind(remote, monkeypatch):
    def broken_pipe(message):
        raise EngineProcessError("the engine process is gone (broken pipe)")
    monkeypatch.setattr(remote, "_send", broken_pipe)
    with pytest.raises(EngineProcessError):
        remote.submit("hi", SamplingParams(max_new_tokens=2))
    assert remote._handles == {}


def test_a_follow_up_reuses_the_cached_prefix_in_the_engine_process(remote):
    system = "A long shared system prompt that fills more than two pages of the cache, " * 3
    first = remote.submit(system + "then a question", SamplingParams(max_new_tokens=4))
    done = first.result(timeout=30)
    follow_up = done.prompt_token_ids + done.token_ids + [11, 12, 13]
    second = remote.submit(follow_up, SamplingParams(max_new_tokens=2))
    second.result(timeout=30)
    stats = remote.stats()
    reused = [r["reused_tokens"] for r in stats["requests"]]
    written = len(done.prompt_token_ids) + len(done.token_ids) - 1
    assert reused[-1] == written // 16 * 16 > 0, reused
    assert stats["prefix_cache"]["hit_tokens"] >= reused[-1] and stats["pages_cached"] > 0


def test_ctrl_c_reaches_the_engine_process_harmlessly(remote):
    handle = remote.submit("keep going", SamplingParams(max_new_tokens=20, ignore_eos=True))
    os.kill(remote._process.pid, signal.SIGINT)        # a terminal's Ctrl-C goes to the whole process group
    assert len(handle.result(timeout=30).token_ids) == 20 and remote._process.is_alive()


@pytest.mark.slow
def test_cancel_after_close_is_a_no_op(model_dir):
    llm = RemoteLLM(model_dir, "numpy", **OPTIONS)
    handle = llm.submit("x", SamplingParams(max_new_tokens=200, ignore_eos=True))
    llm.close()
    handle.cancel()                                    # the server's finally blocks do this
    with pytest.raises(EngineProcessError):
        handle.result(timeout=10)
    with pytest.raises(RuntimeError):                  # a closed engine takes nothing, and keeps nothing
        llm.submit("y", SamplingParams(max_new_tokens=2))
    assert llm._handles == {} and not llm._process.is_alive()
