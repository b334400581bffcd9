"""engine.serve.protocol's request models are strict in the JSON sense and refuse what the engine cannot
honour: a JSON string is never a number or a bool, a float is never an integer, a bool is never a
number (an integer is a number); integers stored in fixed width are bounded; known fields that would
change the answer are a 400 naming the field, fields with no effect on the answer and unknown fields
are ignored. Checked on the models directly and, for a few, through the real server on loopback."""
from __future__ import annotations

import httpx
import pytest
from helpers.serve import MODEL_NAME

pytest.importorskip("pydantic")

from pydantic import ValidationError  # noqa: E402

from engine.serve import protocol as api  # noqa: E402

HELLO = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": HELLO, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", **fields}


def refusal(model: type[api.SamplingRequest], body: dict) -> tuple[str, str]:
    """(param, message) of the 400 the server would send for `body`, the way server.py derives it;
    fails the test if the body is served."""
    try:
        request = model.model_validate(body)
        if isinstance(request, api.CompletionRequest):
            request.single_prompt()
        request.check_supported()
        request.sampling_params()
        if isinstance(request, api.ChatCompletionRequest):
            request.plain_messages()
    except ValidationError as exc:
        err = exc.errors()[0]
        return str(api.param_name(err["loc"])), err["msg"]
    except api.ProtocolError as exc:
        return str(exc.param), str(exc)
    pytest.fail(f"accepted: {body}")


def served(model: type[api.SamplingRequest], body: dict):
    request = model.model_validate(body)
    request.check_supported()
    return request, request.sampling_params()


# ---- types: no coercion between JSON types -------------------------------------------------------

@pytest.mark.parametrize("model, body, param", [
    (api.ChatCompletionRequest, chat(max_tokens="2"), "max_tokens"),
    (api.ChatCompletionRequest, chat(max_tokens=2.0), "max_tokens"),
    (api.ChatCompletionRequest, chat(max_tokens=True), "max_tokens"),
    (api.ChatCompletionRequest, chat(max_completion_tokens="2"), "max_completion_tokens"),
    (api.ChatCompletionRequest, chat(stream="yes"), "stream"),
    (api.ChatCompletionRequest, chat(stream=1), "stream"),
    (api.ChatCompletionRequest, chat(temperature="0.5"), "temperature"),
    (api.ChatCompletionRequest, chat(temperature=True), "temperature"),
    (api.ChatCompletionRequest, chat(top_p="1"), "top_p"),
    (api.ChatCompletionRequest, chat(n="1"), "n"),
    (api.ChatCompletionRequest, chat(n=1.0), "n"),
    (api.ChatCompletionRequest, chat(n=True), "n"),
    (api.ChatCompletionRequest, chat(top_k=5.0), "top_k"),
    (api.ChatCompletionRequest, chat(seed="7"), "seed"),
    (api.ChatCompletionRequest, chat(seed=7.0), "seed"),
    (api.ChatCompletionRequest, chat(ignore_eos="true"), "ignore_eos"),
    (api.ChatCompletionRequest, chat(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (api.ChatCompletionRequest, chat(stop=5), "stop"),
    (api.ChatCompletionRequest, chat(stop=["a", 5]), "stop"),
    (api.ChatCompletionRequest, chat(model=5), "model"),
    (api.ChatCompletionRequest, chat(presence_penalty="0"), "presence_penalty"),
    (api.ChatCompletionRequest, chat(messages="hi"), "messages"),
    (api.ChatCompletionRequest, chat(messages=[]), "messages"),
    (api.ChatCompletionRequest, chat(messages=["hi"]), "messages[0]"),
    (api.ChatCompletionRequest, chat(messages=[{"role": 5, "content": "x"}]), "messages[0].role"),
    (api.ChatCompletionRequest, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (api.ChatCompletionRequest, chat(messages=[{"role": "user", "content": ["hi"]}]), "messages[0].content"),
    (api.ChatCompletionRequest, chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
     "messages[0].content"),
    (api.ChatCompletionRequest, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content"),
    (api.CompletionRequest, completion(prompt=[1.0, 2.0]), "prompt"),
    (api.CompletionRequest, completion(prompt=[1, True]), "prompt"),
    (api.CompletionRequest, completion(prompt=["a", 3]), "prompt"),
    (api.CompletionRequest, completion(prompt=[[1, 2], [3.0]]), "prompt"),
    (api.CompletionRequest, completion(prompt=[[1], 2]), "prompt"),
    (api.CompletionRequest, completion(prompt=5), "prompt"),
    (api.CompletionRequest, completion(prompt={"text": "hi"}), "prompt"),
    (api.CompletionRequest, completion(echo="false"), "echo"),
])
def test_a_value_of_the_wrong_json_type_is_refused(model, body, param):
    assert refusal(model, body)[0] == param


@pytest.mark.parametrize("body, expected", [
    (chat(temperature=1), 1.0),        # an integer is a valid number
    (chat(temperature=0), 0.0),
    (chat(temperature=0.5), 0.5),
    (chat(temperature=None), 1.0),     # null: the default
])
def test_an_integer_is_a_number(body, expected):
    params = served(api.ChatCompletionRequest, body)[1]
    assert params.temperature == expected and type(params.temperature) is float


def test_valid_values_reach_the_sampling_params():
    request, params = served(api.ChatCompletionRequest,
                             chat(max_tokens=5, temperature=0.7, top_p=1, top_k=3, seed=2**63 - 1, stop=["x"],
                                  stream=True, stream_options={"include_usage": True}, n=None))
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.seed, params.stop) == \
        (5, 0.7, 1.0, 3, 2**63 - 1, ("x",))
    assert request.stream is True and request.include_usage is True
    request, params = served(api.ChatCompletionRequest, chat(max_completion_tokens=7))
    assert params.max_new_tokens == 7


@pytest.mark.parametrize("model, body, param, words", [
    (api.ChatCompletionRequest, chat(seed=2**63), "seed", "less than"),
    (api.ChatCompletionRequest, chat(seed=2**64 + 1), "seed", "less than"),
    (api.ChatCompletionRequest, chat(seed=-1), "seed", "greater than"),
    (api.ChatCompletionRequest, chat(top_k=2**31), "top_k", "less than"),
    (api.ChatCompletionRequest, chat(top_k=10**30), "top_k", "less than"),
    (api.ChatCompletionRequest, chat(top_k=-1), "top_k", "0 disables it"),
    (api.CompletionRequest, completion(prompt=[5, 2**31]), "prompt", "prompt[1] must be a token id"),
    (api.CompletionRequest, completion(prompt=[[5, 10**30]]), "prompt", "prompt[0][1] must be a token id"),
    (api.CompletionRequest, completion(prompt=[-1]), "prompt", "in [0, 2**31)"),
])
def test_integers_past_their_width_are_refused_clearly(model, body, param, words):
    got_param, message = refusal(model, body)
    assert got_param == param and words in message and len(message) < 200


def test_token_ids_at_the_bound_are_accepted():
    request = api.CompletionRequest.model_validate(completion(prompt=[0, 2**31 - 1]))
    assert request.single_prompt() == [0, 2**31 - 1]
    nested = api.CompletionRequest.model_validate(completion(prompt=[[3, 4]]))
    assert nested.single_prompt() == [3, 4]
    assert api.CompletionRequest.model_validate(completion(prompt=["a"])).single_prompt() == "a"


# ---- fields that would change the answer: refused, naming the field ------------------------------

REFUSED = [
    (api.ChatCompletionRequest, "n", 17), (api.ChatCompletionRequest, "n", 0),
    (api.CompletionRequest, "best_of", 2), (api.ChatCompletionRequest, "best_of", 3),
    (api.CompletionRequest, "prompt_logprobs", 0),
    (api.ChatCompletionRequest, "guided_grammar", "root ::= 'a'"),
    (api.ChatCompletionRequest, "functions", [{"name": "f"}]),
    (api.ChatCompletionRequest, "function_call", "auto"),
    (api.CompletionRequest, "echo", True), (api.CompletionRequest, "suffix", "tail"),
]


@pytest.mark.parametrize("model, field, value", REFUSED, ids=[f"{f}={v!r}" for _, f, v in REFUSED])
def test_a_field_the_engine_cannot_honour_is_refused(model, field, value):
    body = chat(**{field: value}) if model is api.ChatCompletionRequest else completion(**{field: value})
    param, message = refusal(model, body)
    assert param == field and "supported" in message and field in message


NO_EFFECT = [
    ("n", 1), ("best_of", 1), ("best_of", None), ("logprobs", False), ("logprobs", None), ("top_logprobs", 0),
    ("logit_bias", {}), ("logit_bias", None), ("presence_penalty", 0), ("frequency_penalty", 0.0),
    ("repetition_penalty", 1), ("min_p", 0), ("response_format", {"type": "text"}), ("prompt_logprobs", None),
    ("guided_json", None), ("tools", []), ("tool_choice", "none"), ("functions", []), ("function_call", "none"),
    # no effect on the answer: accepted and ignored
    ("user", "u-1"), ("metadata", {"k": "v"}), ("store", False), ("parallel_tool_calls", True),
    ("service_tier", "auto"), ("stream_options", {"include_usage": False, "continuous_usage_stats": True}),
    ("some_vendor_extra", {"anything": [1, "x"]}),
]


@pytest.mark.parametrize("field, value", NO_EFFECT, ids=[f"{f}={v!r}" for f, v in NO_EFFECT])
def test_a_value_that_changes_nothing_is_accepted(field, value):
    params = served(api.ChatCompletionRequest, chat(max_tokens=3, **{field: value}))[1]
    assert params.max_new_tokens == 3 and params.temperature == 1.0


def test_completion_fields_that_change_nothing_are_accepted():
    request, params = served(api.CompletionRequest, completion(echo=False, suffix="", logprobs=None, best_of=1))
    assert request.single_prompt() == "hi" and params.max_new_tokens == api.DEFAULT_MAX_TOKENS


def test_the_docstring_names_every_refused_field():
    doc = api.__doc__ or ""
    for _, field, _ in REFUSED:
        assert field in doc, field
    for field in ("user", "metadata", "store", "parallel_tool_calls", "service_tier"):
        assert field in doc, field


def test_developer_is_the_system_role_and_parts_are_joined():
    request = api.ChatCompletionRequest.model_validate(chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]))
    assert request.plain_messages() == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]


# ---- through the real server: OpenAI's error object naming the field -----------------------------

@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    pytest.importorskip("starlette")
    from engine.runtime.llm import LLM
    from engine.serve.server import ServerThread
    llm = LLM(tiny_chat_dir, backend="numpy", kv_cache_mib=0.5, max_context=256, max_seqs=4)
    with ServerThread(llm, MODEL_NAME, max_tokens=64) as running:
        yield running


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", chat(max_tokens="2"), "max_tokens"),
    ("/v1/chat/completions", chat(stream="yes"), "stream"),
    ("/v1/chat/completions", chat(temperature="0.5"), "temperature"),
    ("/v1/chat/completions", chat(seed=2**64), "seed"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format"),
    ("/v1/chat/completions", chat(response_format={"type": "yaml"}), "response_format"),
    ("/v1/chat/completions", chat(guided_json={"type": "object", "minProperties": 1}), "response_format"),
    ("/v1/chat/completions", chat(guided_choice=[]), "guided_choice"),
    ("/v1/chat/completions", chat(guided_regex="a", guided_choice=["a"]), "guided_choice"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                  tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    ("/v1/chat/completions", chat(tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", chat(presence_penalty=3), "presence_penalty"),
    ("/v1/chat/completions", chat(logit_bias={"x": 1}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"5": 200}), "logit_bias"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("/v1/completions", completion(prompt=[1.0, 2.0]), "prompt"),
    ("/v1/completions", completion(prompt=[1, 2**40]), "prompt"),
    ("/v1/completions", completion(guided_regex="(a"), "response_format"),
    ("/v1/completions", completion(guided_grammar="root ::= 'a'"), "guided_grammar"),
    ("/v1/completions", completion(logprobs=21), "logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=3), "logprobs"),
])
def test_the_server_answers_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_the_server_serves_ignored_fields_and_an_integer_temperature(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json=chat(max_tokens=2, temperature=0, user="u", store=False, metadata={"a": "b"},
                             tool_choice="none", vendor_extra=True,
                             messages=[{"role": "developer", "content": "Be brief."}, *HELLO]))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
