"""Structured outputs end to end (chapter 17): the engine masks each step's logits with the request's
automaton, so even a random-weight model's sampled output matches the regex, is one of the choices,
or parses as JSON that validates; through the server with the openai client: response_format,
vLLM's guided_* extras, and tool calls (forced, required, a tool-result turn), plain and streamed."""
from __future__ import annotations

import json
import re

import pytest

import engine
from engine.runtime.sampling_params import SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                         "kind": {"enum": ["cat", "dog", 3]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
          "required": ["name", "ok", "kind"]}


def valid(value) -> bool:
    """SCHEMA, checked by hand (no jsonschema dependency)."""
    return (isinstance(value, dict) and set(value) <= {"name", "ok", "kind", "tags"}
            and {"name", "ok", "kind"} <= set(value) and isinstance(value["name"], str) and len(value["name"]) <= 8
            and isinstance(value["ok"], bool) and value["kind"] in ("cat", "dog", 3)
            and (isinstance(value.get("tags", []), list) and len(value.get("tags", [])) <= 2
                 and all(isinstance(t, str) and len(t) <= 3 for t in value.get("tags", []))))


@pytest.fixture(scope="module")
def llm(tiny_chat_dir):
    return engine.LLM(tiny_chat_dir, backend="numpy", max_seqs=8, max_context=512)


def sampled(n: int, structured, temperature: float = 1.5, max_new_tokens: int = 120) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=s, structured=structured)
            for s in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_random_model_samples_only_what_the_regex_allows(tiny_chat_dir, async_scheduling):
    """With async scheduling too: the prompts are admitted over two steps (a small step budget), yet
    the batch stays one and each request decodes every step."""
    llm = engine.LLM(tiny_chat_dir, backend="numpy", max_seqs=8, max_context=512, async_scheduling=async_scheduling,
                     max_batch_tokens=32)
    pattern = r"(yes|no|maybe)[!?]{1,2} [0-9]{4}"
    prompts = [f"Question {i}: is the sky blue today, yes or no?" for i in range(6)]
    outs = llm.generate(prompts, sampled(6, ("regex", pattern)))
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
    assert len({o.text for o in outs}) > 1
    assert len(llm.last_step_log) <= 3 + max(len(o.token_ids) for o in outs)


def test_constrained_rows_run_in_the_lookahead_and_match_one_step_at_a_time(tiny_chat_dir):
    """Async scheduling launches a constrained request's next step before its last token is known: the
    draw waits for it (ModelRunner.finish advances the automaton, then samples), while the forward
    pass runs. The tokens are those of scheduling one step at a time (seeded draws)."""
    prompts = [f"Record {i}:" for i in range(5)]
    params = (sampled(2, ("json_schema", SCHEMA)) + sampled(1, ("regex", r"[a-z]{3,9}( [0-9]{1,3}){2}"))
              + [SamplingParams(max_new_tokens=30, temperature=1.0, seed=9, repetition_penalty=1.3, ignore_eos=True),
                 SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, ignore_eos=True)])
    got, waited = {}, []
    for async_scheduling in (False, True):
        llm = engine.LLM(tiny_chat_dir, backend="numpy", max_seqs=8, max_context=512, async_scheduling=async_scheduling)
        finish = llm.runner.finish

        def counted(step, *args, finish=finish):
            waited.append(step.waiting is not None)
            return finish(step, *args)
        llm.runner.finish = counted
        got[async_scheduling] = [o.token_ids for o in llm.generate(prompts, params)]
        steps = len(llm.last_step_log)
    assert got[True] == got[False]
    assert sum(waited) >= steps - 3          # every step but the first ones waited for the one in flight


def test_the_runners_matchers_follow_reused_ids_and_retried_steps(llm):
    """The runner's per-request matchers (engine/runtime/structured_outputs.py) start again for another
    request under a reused id (a hand-driven scheduler restarts ids), even before either took a
    token, and when a retried step's token differs from the one they took."""
    import numpy as np

    from engine.structured.token_mask import TokenMatcher
    s = llm.runner.structured
    digits, letters = ("regex", "[0-9]{1,4}x"), ("regex", "[a-z]{1,4}")

    def mask(structured, output):
        slot = s.slots([(777, structured, output)])[0]
        return np.asarray(s.table[slot])

    def fresh(structured, output):
        m = TokenMatcher(s.compile(structured))
        for token in output:
            m.advance(token)
        return m.allowed_mask()

    np.testing.assert_array_equal(mask(digits, []), fresh(digits, []))
    np.testing.assert_array_equal(mask(letters, []), fresh(letters, []))       # same id, not a token yet
    first = fresh(digits, [])
    a, b = (int(t) for t in np.flatnonzero(first)[:2])
    np.testing.assert_array_equal(mask(digits, []), fresh(digits, []))
    np.testing.assert_array_equal(mask(digits, [a]), fresh(digits, [a]))
    np.testing.assert_array_equal(mask(digits, [b]), fresh(digits, [b]))       # the step again, another token
    assert not np.array_equal(fresh(digits, []), fresh(letters, []))
    # a table key whose constraint id now belongs to another constraint (the old one was freed) gets a
    # row of its own, and the next new state does not land on a row in use
    compiled = s.compile(digits)
    key = (id(compiled), compiled.dfa.start, False)
    s._slots[key] = (s._slots[key][0], object())
    in_use = {held[0] for held in s._slots.values()}
    renewed = s.slots([(778, digits, [])])[0]
    assert renewed not in in_use
    letter = int(np.flatnonzero(fresh(letters, []))[0])
    unseen = s.slots([(779, letters, [letter])])[0]                # a state no row holds yet
    assert unseen not in in_use | {renewed}
    np.testing.assert_array_equal(np.asarray(s.table[renewed]), fresh(digits, []))
    np.testing.assert_array_equal(np.asarray(s.table[unseen]), fresh(letters, [letter]))


def test_choices_and_json_schema_validate_whatever_the_weights(llm):
    for out in llm.generate(["Pick:"] * 4, sampled(4, ("choice", ["red", "green", "deep blue"]))):
        assert out.text in ("red", "green", "deep blue")
    outs = llm.generate(["JSON:"] * 6, sampled(6, ("json_schema", SCHEMA)))
    for out in outs:
        assert out.finish_reason == "stop" and valid(json.loads(out.text)), out.text
    greedy = llm.generate(["JSON:"], [SamplingParams(max_new_tokens=120, structured=("json_schema", SCHEMA))])[0]
    assert valid(json.loads(greedy.text))


def test_a_constrained_request_beside_plain_ones_and_speculating_ones(tiny_chat_dir):
    fast = engine.LLM(tiny_chat_dir, backend="numpy", max_seqs=4, max_context=512,
                      speculative={"method": "ngram", "num_tokens": 3})
    plain = engine.LLM(tiny_chat_dir, backend="numpy", max_seqs=4, max_context=512)
    prompts = ["a b a b a b", "JSON:"]
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True),
              SamplingParams(max_new_tokens=120, structured=("json_schema", SCHEMA))]
    got, want = fast.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert valid(json.loads(got[1].text))


def test_json_mode_gives_a_real_model_one_json_object(default_model_dir):
    real = engine.LLM(default_model_dir, backend="numpy", max_context=512)
    ask = "A JSON object with the keys name and age for Tom, a cat of 3."
    prompt = real.tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
    out = real.generate([prompt], SamplingParams(max_new_tokens=160, structured=("json_object", None)))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


def test_a_bad_constraint_is_refused_before_it_runs(llm):
    from engine.structured.regex_dfa import StructuredError
    with pytest.raises(StructuredError):
        llm.generate(["x"], SamplingParams(structured=("regex", "(a")))
    with pytest.raises(StructuredError):
        llm.generate(["x"], SamplingParams(structured=("json_schema", {"type": "object", "patternProperties": {}})))


# ---- through the server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def openai():
    return pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(llm, openai):
    pytest.importorskip("starlette")
    from helpers.serve import MODEL_NAME

    from engine.serve.server import ServerThread
    with ServerThread(llm, MODEL_NAME) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120), MODEL_NAME


HELLO = [{"role": "user", "content": "Describe a pet as JSON."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def test_response_format_and_guided_extras_through_the_client(client, openai):
    c, model = client
    kwargs = dict(model=model, messages=HELLO, max_tokens=150, temperature=1.2, seed=3)
    out = c.chat.completions.create(response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
                                    **kwargs)
    assert valid(json.loads(out.choices[0].message.content))
    streamed = list(c.chat.completions.create(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
                                              stream=True, **kwargs))
    assert valid(json.loads("".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)))
    choice = c.chat.completions.create(extra_body={"guided_choice": ["alpha", "beta"]}, **kwargs)
    assert choice.choices[0].message.content in ("alpha", "beta")
    text = c.completions.create(model=model, prompt="Code:", max_tokens=20, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", text.choices[0].text)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(extra_body={"guided_regex": "(unclosed"}, **kwargs)
    assert info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}, **kwargs)


def test_a_forced_tool_call_plain_and_streamed(client):
    c, model = client
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, TIME],
                  max_tokens=80, temperature=1.0, seed=1)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = c.chat.completions.create(tool_choice=named, **kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F")
    chunks = list(c.chat.completions.create(tool_choice=named, stream=True, **kwargs))
    deltas = [ch.choices[0].delta.tool_calls[0] for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args      # same seed, same call
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]
    required = c.chat.completions.create(tool_choice="required", **kwargs).choices[0]
    call = required.message.tool_calls[0]
    assert required.finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
    assert json.loads(call.function.arguments)
    streamed = [ch for ch in c.chat.completions.create(tool_choice="required", stream=True, **kwargs)]
    calls = [tc for ch in streamed if ch.choices and ch.choices[0].delta.tool_calls for tc in ch.choices[0].delta.tool_calls]
    assert calls[0].function.name == call.function.name and json.loads(calls[0].function.arguments)


def test_a_tool_result_turn_renders_and_answers(client):
    c, model = client
    first = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                      tools=[WEATHER], tool_choice="required", max_tokens=80, seed=2)
    call = first.choices[0].message.tool_calls[0]
    follow = c.chat.completions.create(model=model, tools=[WEATHER], max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, rain"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.usage.prompt_tokens > first.usage.prompt_tokens


def test_the_structured_bench_runs_on_the_cpu(capsys, default_model_dir):
    from engine.bench import run as bench
    bench.main(["--model", str(default_model_dir), "--backend", "numpy", "--scenario", "structured",
                "--requests", "1", "--new-tokens", "8"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    runs = [r for r in records if r.get("scenario") == "structured"]
    assert [r["mode"] for r in runs] == ["free", "free+sync"] + ["schema", "matched"] * 3
    for r in runs:
        assert r["output_tokens"] > 0 and r["output_tok_per_s"] > 0
        if r["mode"] == "schema":
            assert r["masks_built"] + r["masks_reused"] == r["output_tokens"]
    assert runs[2]["output_tokens"] == runs[1]["output_tokens"] and runs[5]["output_tokens"] == runs[4]["output_tokens"]
