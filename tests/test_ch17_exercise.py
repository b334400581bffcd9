"""Chapter 17 checkers: the token mask (crafted traps, real constraints over SmolLM2's vocabulary, seeded
random vocabularies; named mistakes) and a structured reply through the server. The reference mask and
a vectorized one pass; each classic mistake gets its named verdict; a broken contract is named;
unfinished work is reported as not attempted."""
from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.exercises import accepts, not_attempted, rejects

from engine.exercises import ch17


@pytest.fixture(scope="module", autouse=True)
def _model(default_model_dir):
    """The checkers read the default model's tokenizer (and serve the model): converted once."""
    return default_model_dir


def columns_mask(table, accepting, state, token_bytes, eos_ids):
    """Right, vectorized: byte j of every token longer than j at once (the chapter's exercise 3)."""
    lengths = np.fromiter(map(len, token_bytes), dtype=np.int64, count=len(token_bytes))
    data = np.frombuffer(b"".join(token_bytes), dtype=np.uint8)
    order = np.argsort(-lengths, kind="stable")
    starts = (np.cumsum(lengths) - lengths)[order]
    longer = len(token_bytes) - np.cumsum(np.bincount(lengths))
    s = np.full(len(token_bytes), state, dtype=np.int64)
    for j in range(int(lengths.max())):
        s[:longer[j]] = table[s[:longer[j]], data[starts[:longer[j]] + j]]
    mask = np.zeros(len(token_bytes), dtype=bool)
    mask[order] = (s != 0) & (lengths[order] > 0)
    mask[list(eos_ids)] = bool(accepting[state])
    return mask


def returns_ids(table, accepting, state, token_bytes, eos_ids):
    return np.flatnonzero(ch17.token_mask_reference(table, accepting, state, token_bytes, eos_ids)).tolist()


def returns_ints(table, accepting, state, token_bytes, eos_ids):
    return ch17.token_mask_reference(table, accepting, state, token_bytes, eos_ids).astype(np.int8)


def forgets_the_last_byte(table, accepting, state, token_bytes, eos_ids):
    return ch17.token_mask_reference(table, accepting, state, [b[:-1] if len(b) > 1 else b for b in token_bytes],
                                     eos_ids)


def decodes_the_token(table, accepting, state, token_bytes, eos_ids):
    """Walks the characters of the decoded token, not its bytes."""
    mask = np.zeros(len(token_bytes), dtype=bool)
    for i, data in enumerate(token_bytes):
        s = state
        for c in data.decode("utf-8"):
            s = table[s, ord(c)]
        mask[i] = bool(data) and s != 0
    mask[list(eos_ids)] = bool(accepting[state])
    return mask


def test_the_reference_and_a_vectorized_mask_pass(capsys):
    accepts(ch17.check_token_mask, ch17.token_mask_reference, capsys)
    accepts(ch17.check_token_mask, columns_mask, capsys)


@pytest.mark.parametrize("fn, hint", [
    (ch17.first_byte_mask, "checking only the first byte"),
    (ch17.eos_anywhere_mask, "allowing eos in a state that does not accept"),
    (ch17.eos_never_mask, "never allowing eos"),
    (ch17.empty_tokens_mask, "allowing the tokens with no bytes"),
    (ch17.whole_characters_mask, "forgetting multi-byte UTF-8"),
    (ch17.accepting_only_mask, "allowing only the tokens after which the output is complete"),
])
def test_each_classic_mistake_is_named(fn, hint, capsys):
    rejects(ch17.check_token_mask, fn, capsys, hint)


@pytest.mark.parametrize("fn, hint", [
    (returns_ids, "return a NumPy bool array with one entry per token"),
    (returns_ints, "dtype int8"),
    (decodes_the_token, "raised UnicodeDecodeError"),
    (forgets_the_last_byte, "the engine's mask refuses, e.g. id 4 b'1a'"),
])
def test_a_broken_contract_or_an_unnamed_mistake_is_shown(fn, hint, capsys):
    rejects(ch17.check_token_mask, fn, capsys, hint)


def test_the_mistakes_differ_from_the_engine_only_where_they_say():
    """Each mistake's mask equals the engine's except on the tokens its name is about (the diagnosis
    reads that difference), on a real state where they all apply: the free string of the pet schema."""
    import engine
    from engine.structured.token_mask import TokenVocabulary, compile_constraint
    vocab = TokenVocabulary.from_tokenizer(engine.load_tokenizer(engine.ensure_default_model()))
    pet = compile_constraint("json_schema", ch17.PET_SCHEMA, vocab)
    table = ch17.byte_table(pet.dfa)
    state = ch17.walk_bytes(table, pet.dfa.start, b'{"name": "')[-1]
    args = (table, np.asarray(pet.dfa.accepting), state, vocab.token_bytes, vocab.eos_token_ids)
    want = pet.allowed(state)
    assert np.array_equal(ch17.token_mask_reference(*args), want)
    wrong = {fn.__name__: np.flatnonzero(fn(*args) != want) for fn in
             (ch17.first_byte_mask, ch17.empty_tokens_mask, ch17.whole_characters_mask, ch17.eos_anywhere_mask)}
    assert all(ids.size for ids in wrong.values()), wrong
    assert set(wrong["empty_tokens_mask"]) == set(range(17)) - {2}
    assert set(wrong["eos_anywhere_mask"]) == {2}
    assert all(not ch17.valid_utf8(vocab.token_bytes[i]) for i in wrong["whole_characters_mask"])


def test_the_verdict_is_deterministic_and_fast(capsys):
    import time
    start = time.perf_counter()
    ch17.check_token_mask(ch17.token_mask_reference)
    first = capsys.readouterr().out
    assert time.perf_counter() - start < 15
    ch17.check_token_mask(ch17.token_mask_reference)
    assert capsys.readouterr().out == first


def test_not_attempted(capsys):
    assert ch17.check_token_mask(not_attempted) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_the_validator():
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3},
                             "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
                             "c": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "null"}]}}}
    assert ch17.schema_problems({"a": 3, "b": ["x"], "c": None}, schema) == []
    assert ch17.schema_problems({"a": True}, schema)                      # a bool is not an integer
    assert ch17.schema_problems({"a": 4}, schema) and ch17.schema_problems({}, schema)
    assert ch17.schema_problems({"a": 1, "b": ["x", "z"]}, schema) and ch17.schema_problems({"a": 1, "d": 1}, schema)
    assert ch17.schema_problems({"a": 1, "c": "abc"}, schema) and ch17.schema_problems({"a": 1, "b": ["x"] * 3}, schema)


def test_show_dfa(capsys):
    from engine.structured.regex_dfa import compile_regex
    ch17.show_dfa(compile_regex("yes|no"))
    out = capsys.readouterr().out
    assert "state 1 (start): [n] -> 2,  [y] -> 3" in out and "(accepts): no moves" in out


# ---- exercise 2: through the server (the default model answers: slower) -----------------------------------

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def llm(default_model_dir):
    import engine
    llm = engine.LLM(default_model_dir, backend="numpy", max_seqs=2, max_context=512)
    yield llm
    llm.close()


def _ask(client, model, question, response_format=None, max_tokens=80):
    kwargs = {} if response_format is None else {"response_format": response_format}
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=max_tokens, temperature=0, **kwargs)
    return reply.choices[0].message.content


def structured_reply(client, model, question, schema):
    return json.loads(_ask(client, model, question, {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}))


def guided_json(client, model, question, schema):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=80, temperature=0, extra_body={"guided_json": schema})
    return json.loads(reply.choices[0].message.content)


def the_text(client, model, question, schema):
    return _ask(client, model, question, {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})


def json_object_mode(client, model, question, schema):
    return json.loads(_ask(client, model, question, {"type": "json_object"}, max_tokens=40))


def too_few_tokens(client, model, question, schema):
    return json.loads(_ask(client, model, question, {"type": "json_schema", "json_schema": {"schema": schema}},
                           max_tokens=3))


BOOK = {"type": "object", "required": ["title", "year"],
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "year": {"type": "integer", "minimum": 1000, "maximum": 2030}}}


@pytest.mark.slow
def test_a_structured_reply_passes_with_the_learners_schema(llm, capsys):
    accepts(lambda fn: ch17.check_structured_reply(fn, schema=BOOK, question="Name a famous novel.", llm=llm),
            structured_reply, capsys)
    accepts(lambda fn: ch17.check_structured_reply(fn, llm=llm), guided_json, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("fn, hint", [
    (the_text, "return the parsed object"),
    (json_object_mode, "it looks like the schema was not sent: json_object mode"),
    (too_few_tokens, "the reply is not JSON"),
])
def test_a_wrong_structured_reply_is_named(fn, hint, llm, capsys):
    rejects(lambda f: ch17.check_structured_reply(f, llm=llm), fn, capsys, hint)


def test_a_schema_the_engine_refuses_and_not_attempted(llm, capsys):
    rejects(lambda f: ch17.check_structured_reply(f, schema={"type": "object", "patternProperties": {}}, llm=llm),
            structured_reply, capsys, "the engine refuses your schema")
    assert ch17.check_structured_reply(not_attempted, llm=llm) is False
    assert "not attempted yet" in capsys.readouterr().out
