"""`engine.serve.server` through the real `openai` client: the API's objects, streaming, stop strings, errors,
disconnects, and a bounded load test on loopback (nothing lost, no page leaked, greedy outputs equal to
LLM.generate)."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from helpers.serve import MODEL_NAME

openai = pytest.importorskip("openai")

from engine.runtime.engine_process import RemoteLLM  # noqa: E402
from engine.runtime.llm import LLM  # noqa: E402
from engine.runtime.sampling_params import SamplingParams  # noqa: E402
from engine.serve.server import ServerThread  # noqa: E402

GREEDY = {"temperature": 0.0}
HELLO = [{"role": "user", "content": "Hello! Tell me about pages."}]


# A small pool (64 pages of 16 tokens) so that the load test queues requests and recycles pages.
OPTIONS = {"kv_cache_mib": 0.5, "max_context": 256, "max_seqs": 12}


@pytest.fixture(scope="module")
def model_dir(tiny_chat_dir):
    return tiny_chat_dir


@pytest.fixture(scope="module")
def llm(model_dir):
    """The reference: LLM.generate in this process."""
    return LLM(model_dir, backend="numpy", **OPTIONS)


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def served(request, llm, model_dir):
    """The engine behind the server: the reference LLM itself, or the same model in an engine process
    (what `python -m engine.serve` runs by default)."""
    if request.param == "in-process":
        yield llm
        return
    with RemoteLLM(model_dir, "numpy", **OPTIONS) as remote:
        yield remote


@pytest.fixture(scope="module")
def server(served):
    with ServerThread(served, MODEL_NAME) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(llm, timeout=30.0) -> dict:
    """The engine's stats once nothing runs or waits (cancellations land at the next step)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.stats()
        if (stats["running"], stats["waiting"], stats["pages_used"]) == (0, 0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def chat_prompt_len(llm, messages) -> int:
    tok = llm.tokenizer
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True)))


# ---- the API's objects -------------------------------------------------------------------------

def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model"


def test_chat_completion_plain_and_streamed_agree(client, llm):
    plain = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=12, **GREEDY)
    choice = plain.choices[0]
    assert plain.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert plain.usage.prompt_tokens == chat_prompt_len(llm, HELLO)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content and reasons == [choice.finish_reason]
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_text_completion_equals_llm_generate(client, llm):
    prompt = "The KV cache stores"
    reference = llm.generate([prompt], SamplingParams(max_new_tokens=10))[0]
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, **GREEDY)
    assert plain.object == "text_completion"
    assert plain.choices[0].text == reference.text
    assert plain.choices[0].finish_reason == reference.finish_reason
    assert plain.usage.completion_tokens == len(reference.token_ids)
    assert plain.usage.prompt_tokens == len(reference.prompt_token_ids)
    streamed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reference.text


def test_token_id_prompt_and_seeded_sampling(client, llm):
    ids = llm.tokenizer.encode("Seeds make sampling repeatable", add_special_tokens=True)
    kwargs = dict(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
                  extra_body={"top_k": 50})
    first, second = (client.completions.create(**kwargs) for _ in range(2))
    reference = llm.generate([ids], SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=7))
    assert first.choices[0].text == second.choices[0].text == reference[0].text


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_404(client):
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_n_choices_equal_separate_requests_with_derived_seeds(client, llm, served):
    """n > 1: choice i samples with seed + i, so it equals a request of its own with that seed; the
    choices share the prompt's pages (the engine's prefix cache); best_of = n is the same request.
    (A random model's logits span tens of units: temperature 20 spreads its choices.)"""
    kwargs = dict(model=MODEL_NAME, max_tokens=8, temperature=20.0, seed=11)
    hits = served.stats()["prefix_cache"]["hit_tokens"]
    many = client.chat.completions.create(messages=HELLO, n=3, **kwargs)
    full_pages = chat_prompt_len(llm, HELLO) // llm.page_size * llm.page_size
    assert served.stats()["prefix_cache"]["hit_tokens"] - hits >= 2 * full_pages > 0   # the prompt computed once
    assert [c.index for c in many.choices] == [0, 1, 2]
    used = 0
    for i, choice in enumerate(many.choices):
        alone = client.chat.completions.create(messages=HELLO, **{**kwargs, "seed": 11 + i})
        assert choice.message.content == alone.choices[0].message.content
        assert choice.finish_reason == alone.choices[0].finish_reason
        used += alone.usage.completion_tokens
    assert len({c.message.content for c in many.choices}) == 3          # distinct under sampling
    assert many.usage.completion_tokens == used and many.usage.prompt_tokens == alone.usage.prompt_tokens
    streamed = list(client.chat.completions.create(messages=HELLO, n=3, stream=True,
                                                   stream_options={"include_usage": True}, **kwargs))
    for i, choice in enumerate(many.choices):
        parts = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == i]
        assert parts[0].delta.role == "assistant"
        assert "".join(p.delta.content or "" for p in parts) == choice.message.content
        assert [p.finish_reason for p in parts if p.finish_reason] == [choice.finish_reason]
    assert streamed[-1].usage.completion_tokens == many.usage.completion_tokens
    text = client.completions.create(prompt="Pages are", n=2, best_of=2, **kwargs)
    streamed_text = list(client.completions.create(prompt="Pages are", n=2, stream=True, **kwargs))
    for i in range(2):
        assert "".join(c.choices[0].text for c in streamed_text if c.choices and c.choices[0].index == i) \
            == text.choices[i].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt="Pages are", n=2, best_of=3, **kwargs)


def test_penalties_and_logit_bias_reach_the_engine(client, llm):
    """The served sampling fields give what LLM.generate gives with the same SamplingParams."""
    prompt = "The KV cache stores"
    token = llm.tokenizer.encode(" pages")[0]
    forced = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, logit_bias={str(token): 100},
                                       **GREEDY)
    assert forced.choices[0].text == llm.tokenizer.decode([token] * 5)
    kwargs = dict(presence_penalty=1.5, frequency_penalty=0.5, max_tokens=12)
    got = client.completions.create(model=MODEL_NAME, prompt=prompt, extra_body={"repetition_penalty": 1.3, "min_p": 0.1},
                                    temperature=0.8, seed=5, **kwargs)
    want = llm.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.8, seed=5, presence_penalty=1.5,
                                                 frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.1))[0]
    assert got.choices[0].text == want.text


def test_logprobs_through_the_client_equal_the_engines(client, llm):
    """chat: logprobs + top_logprobs, plain and streamed; completions: logprobs=N; the numbers are
    LLM.generate's for the same request (the model's log-softmax)."""
    want = llm.generate([llm.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True)],
                        SamplingParams(max_new_tokens=6, logprobs=2))[0]
    got = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=6, logprobs=True,
                                         top_logprobs=2, **GREEDY)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp for lp, _ in want.logprobs], abs=1e-5)
    assert [[a.token for a in c.top_logprobs] for c in content] == \
        [[llm.tokenizer.token_bytes([t]).decode("utf-8", "replace") for t, _ in top] for _, top in want.logprobs]
    if got.choices[0].finish_reason == "length":       # (no end-of-turn token among them)
        assert b"".join(bytes(c.bytes) for c in content) == got.choices[0].message.content.encode()
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=6, logprobs=True,
                                                   top_logprobs=2, stream=True, **GREEDY))
    lps = [c.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert lps == pytest.approx([c.logprob for c in content][:len(lps)], abs=1e-5) and len(lps) >= len(content) - 1
    plain = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=3, **GREEDY)
    assert plain.choices[0].logprobs is None
    text = client.completions.create(model=MODEL_NAME, prompt="Pages are", max_tokens=5, logprobs=3, **GREEDY)
    lp = text.choices[0].logprobs
    ref = llm.generate(["Pages are"], SamplingParams(max_new_tokens=5, logprobs=3))[0]
    assert lp.token_logprobs == pytest.approx([v for v, _ in ref.logprobs], abs=1e-5)
    assert len(lp.top_logprobs) == len(ref.token_ids) and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset[0] == 0


# ---- stop strings ------------------------------------------------------------------------------

def test_stop_strings_cut_the_text_plain_and_streamed(client):
    full = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24,
                                     extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
    assert len(full) > 8, full
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, stop=[stop],
                                        stream=stream, extra_body={"ignore_eos": True}, **GREEDY)
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_stop_string_in_chat(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=16, **GREEDY)
    text = full.choices[0].message.content
    stop = text[3:5]
    out = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=16, stop=stop, **GREEDY)
    assert out.choices[0].message.content == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"stop": [""]}, "stop"),
])
def test_invalid_values_are_400_with_an_error_object(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=HELLO, **kwargs)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


def test_prompt_that_cannot_fit_is_400(client, served):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[5] * 300, max_tokens=4)
    assert "context" in info.value.body["message"] and info.value.body["param"] == "prompt"
    assert wait_idle(served)["pages_used"] == 0


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert info.value.body["code"] == "model_not_found" and "tiny-chat" in info.value.body["message"]


def test_malformed_requests_get_error_objects(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_NAME}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.get(server.url + "/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


# ---- operations --------------------------------------------------------------------------------

def metrics_values(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


def metrics_once(server, ready) -> dict[str, float]:
    """/metrics serves the background sampler's last picture: read it until `ready(values)` (a few
    samples at most; bounded by the number of reads, not by a clock)."""
    for _ in range(400):
        values = metrics_values(server)
        if ready(values):
            return values
        time.sleep(0.05)
    raise AssertionError(f"/metrics never showed the expected values: {values}")


def test_health_and_metrics(server, client):
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    before = metrics_values(server).get("engine_generation_tokens_total", 0)
    client.completions.create(model=MODEL_NAME, prompt="count", max_tokens=3, **GREEDY)
    values = metrics_once(server, lambda v: v["engine_generation_tokens_total"] >= before + 3)
    for name in ("engine_requests_running", "engine_requests_waiting", "engine_kv_pages_used",
                 "engine_kv_pages_total", "engine_tokens_per_second", "engine_generation_tokens_total"):
        assert name in values, name
    assert values["engine_kv_pages_total"] == 64
    assert values["engine_time_to_first_token_seconds_count"] >= 1
    assert 0 < values['engine_time_to_first_token_seconds{quantile="0.5"}'] < 60
    # the same long prompt again: its pages come from the prefix cache, and the counters say so
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt="a shared system prompt " * 16, max_tokens=2, **GREEDY)
    after = metrics_once(server, lambda v: v["engine_prefix_cache_hits_total"]
                         >= 32 + values["engine_prefix_cache_hits_total"])
    assert after["engine_prefix_cache_queries_total"] > after["engine_prefix_cache_hits_total"]
    assert after["engine_kv_pages_cached"] > 0 and after["engine_kv_pages_shared"] == 0


def test_disconnect_cancels_the_request(server, served):
    body = {"model": MODEL_NAME, "prompt": "a long answer", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "text_completion"
    stats = wait_idle(served)
    assert (stats["running"], stats["waiting"], stats["pages_used"]) == (0, 0, 0)


# ---- load --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_concurrent_streaming_clients(server, served, llm):
    """48 streaming clients at once, random lengths, every fourth one hangs up after two chunks."""
    rng = random.Random(0)
    words = "page cache token batch prefill decode queue stream".split()
    jobs = [(" ".join(rng.choices(words, k=rng.randint(1, 24))), rng.randint(1, 24), i % 4 == 3) for i in range(48)]
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = served.stats()["tokens_generated"]

    async def one(prompt, max_tokens, hang_up):
        stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                  stream=True, extra_body={"ignore_eos": True}, **GREEDY)
        text, reasons, chunks = [], [], 0
        async for chunk in stream:
            chunks += 1
            if chunk.choices:
                text.append(chunk.choices[0].text)
                if chunk.choices[0].finish_reason:
                    reasons.append(chunk.choices[0].finish_reason)
            if hang_up and chunks == 2:
                await stream.close()
                return None
        return "".join(text), reasons

    async def everyone():
        try:
            return await asyncio.gather(*(one(*job) for job in jobs))
        finally:
            await aclient.close()

    outputs = asyncio.run(everyone())
    stats = wait_idle(served)
    assert (stats["running"], stats["waiting"], stats["pages_used"]) == (0, 0, 0)
    assert set(stats["page_owners"]) <= {-1, -2}          # free, or free and holding a cached prefix
    if served is llm:
        with llm._engine.lock:                      # the loop is at rest: read its allocator
            llm._engine.scheduler.allocator.check_invariants()
    served = [(job, out) for job, out in zip(jobs, outputs, strict=True) if not job[2]]
    reference = llm.generate([p for (p, _, _), _ in served],
                             [SamplingParams(max_new_tokens=n, ignore_eos=True) for (_, n, _), _ in served])
    for ((prompt, _, _), out), ref in zip(served, reference, strict=True):
        assert out == (ref.text, ["length"]), prompt
    assert stats["tokens_generated"] - before >= sum(n for (_, n, _), _ in served)
