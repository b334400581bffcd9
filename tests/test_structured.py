"""engine/structured: regex -> DFA over UTF-8 bytes, JSON schema -> regex, token masks over a vocabulary.

- the DFA agrees with Python's re.fullmatch (re.ASCII: \\d \\w \\s are ASCII here) on fixed patterns and
  on random ones from a small grammar, for strings drawn both inside and outside each language;
- hostile and unsupported patterns are refused quickly with a StructuredError that names the problem;
- JSON schemas accept json.dumps of valid instances in three whitespace styles and refuse invalid ones;
  unsupported keywords are refused, annotations ignored;
- exact masks over a hand-made byte vocabulary; with the default model's real tokenizer, random
  walks (a random allowed token each step, eos only where the DFA accepts) always end in text that
  matches the regex, is one of the choices, or parses as JSON valid under the schema.
"""
from __future__ import annotations

import datetime
import json
import re
import time
import uuid
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.structured.token_mask as token_mask
from engine.structured.json_schema import JSON_OBJECT_DEPTH, int_range_regex, json_object_regex, schema_to_regex, schema_to_tree
from engine.structured.regex_dfa import (
    MAX_DFA_STATES,
    StructuredError,
    build_dfa,
    compile_regex,
    escape,
    parse,
    to_regex,
    utf8_sequences,
)
from engine.structured.token_mask import TokenMatcher, TokenVocabulary, compile_constraint, constraint_regex

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:      # a lone surrogate: no UTF-8, so no bytes to match
        return False


# ---------------------------------------------------------------------------------------------
# regex -> DFA agrees with re.fullmatch

PATTERNS = [
    r"a+b", r"(a|b)*abb", r"[a-z0-9_]{2,5}", r"\d+(\.\d+)?", r"-?(?:0|[1-9]\d*)", r'"(?:[^"\\]|\\.)*"',
    r"[^abc]*", r"colou?r", r"(?:ab|cd){2,}", r"x{3}", r"x{,2}y", r"\w+\s\w+", r"[\d\s]+", r"[^\d\s]+",
    r"(a|)b", r"é+|ü?", r"[à-ÿ]+", r"[^é]", r"\u00e9\u4e2d", r"[\u4e00-\u9fff]{1,3}", r"[😀-😂]x", r".", r".*z",
    r"(?P<year>\d{4})-(?P<month>\d\d)", r"a{", r"[]a]+", r"[a-]", r"\.\*\\", r"(?:ab*)*c", r"[\x00-\x1f]",
    r"^abc$", r"(a|b|c)?d{1,3}", r"\D\W\S", r"[^\x00-\x7f]+", r"\/\"", r"a*?b+?c??", r"[\t\n ]{0,2}x",
]
ALPHABET = "abcdxyz0189 _-.\"\\\n\t{}é€ü中😀\x00"


@pytest.mark.parametrize("pattern", PATTERNS)
@SETTINGS
@given(data=st.data())
def test_dfa_agrees_with_re(pattern, data):
    compiled = re.compile(pattern, re.ASCII)
    dfa = compile_regex(pattern)
    printed = re.compile(to_regex(parse(pattern)), re.ASCII)     # the tree printed back: the same language
    inside = data.draw(st.lists(st.from_regex(compiled, fullmatch=True).filter(encodable).filter(lambda s: len(s) <= 16),
                                max_size=4))
    outside = data.draw(st.lists(st.text(alphabet=ALPHABET, max_size=8), max_size=8))
    for s in inside + outside + [s[:-1] for s in inside] + [s + "a" for s in inside]:
        expected = compiled.fullmatch(s) is not None
        assert dfa.fullmatch(s) == expected, (pattern, s)
        assert (printed.fullmatch(s) is not None) == expected, (pattern, to_regex(parse(pattern)), s)


_ATOMS = st.sampled_from(["a", "b", "c", "[ab]", "[^a]", ".", r"\d", "[a-c]", "(?:)", "é", "[^é1]", r"\n"])


def _combine(children):
    pair = st.tuples(children, children)
    bounds = st.tuples(st.integers(0, 3), st.integers(0, 3)).map(sorted)
    return st.one_of(
        pair.map(lambda t: t[0] + t[1]),
        pair.map(lambda t: f"(?:{t[0]}|{t[1]})"),
        children.map(lambda c: f"(?:{c})*"),
        children.map(lambda c: f"(?:{c})+"),
        children.map(lambda c: f"(?:{c})?"),
        st.tuples(children, bounds).map(lambda t: f"(?:{t[0]}){{{t[1][0]},{t[1][1]}}}"),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.recursive(_ATOMS, _combine, max_leaves=8), data=st.data())
def test_random_patterns_agree_with_re(pattern, data):
    compiled = re.compile(pattern, re.ASCII)
    dfa = compile_regex(pattern)
    strings = data.draw(st.lists(st.text(alphabet="abcé1\n", max_size=10), min_size=5, max_size=20))
    # short strings only: nested quantifiers make Python's backtracking re exponential in the length
    strings += data.draw(st.lists(st.from_regex(compiled, fullmatch=True).filter(encodable).filter(lambda s: len(s) <= 10),
                                  max_size=3))
    for s in strings:
        assert dfa.fullmatch(s) == (compiled.fullmatch(s) is not None), (pattern, s)


@SETTINGS
@given(text=st.text(max_size=12).filter(encodable))
def test_escape_matches_exactly_the_text(text):
    assert compile_regex(escape(text)).fullmatch(text)
    assert re.fullmatch(escape(text), text)
    assert not compile_regex(escape(text)).fullmatch(text + "x")


@SETTINGS
@given(lo=st.integers(0, 0x10FFFF), span=st.integers(0, 0x3000), probes=st.lists(st.integers(-200, 0x3200), max_size=30))
def test_utf8_sequences_cover_exactly_the_range(lo, span, probes):
    hi = min(lo + span, 0x10FFFF)
    seqs = utf8_sequences(lo, hi)
    boundaries = [lo - 1, lo, hi, hi + 1, 0x7F, 0x80, 0x7FF, 0x800, 0xFFFF, 0x10000, 0xD7FF, 0xE000]
    for code in boundaries + [lo + p for p in probes]:
        if not 0 <= code <= 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            continue
        data = chr(code).encode()
        hits = sum(len(seq) == len(data) and all(a <= b <= c for (a, c), b in zip(seq, data)) for seq in seqs)
        assert hits == (1 if lo <= code <= hi else 0), (hex(lo), hex(hi), hex(code))


def test_dfa_is_minimal_and_matches_bytes():
    dfa = compile_regex("(?:ab|ab)(?:c|c)*")
    assert dfa.n_states == 4                     # dead, start, after a, after ab (c loops)
    assert dfa.byte_table().shape == (4, 256) and (dfa.byte_table()[0] == 0).all()     # state 0: dead
    assert dfa.fullmatch(b"abcc") and not dfa.fullmatch(b"ab\xff")
    assert compile_regex("é").walk(compile_regex("é").start, b"\xc3") != 0       # half a character: still alive
    distances = compile_regex("abc").distances_to_accept()
    assert sorted(distances.tolist()) == [-1, 0, 1, 2, 3]


@pytest.mark.parametrize("pattern", ["(?:ab|a)*c?", "[^a]{0,30}b", r'"(?:[^"\\]|\\.){0,5}"'])
def test_unminimized_fallback_is_correct(pattern, monkeypatch):
    """Past MAX_MINIMIZE_WORK the DFA stays as the subset construction built it, dead states pruned."""
    import engine.structured.regex_dfa as regex_dfa
    minimal = regex_dfa.build_dfa(parse(pattern))
    monkeypatch.setattr(regex_dfa, "MAX_MINIMIZE_WORK", 0)
    pruned = regex_dfa.build_dfa(parse(pattern))
    assert pruned.n_states >= minimal.n_states
    assert (pruned.distances_to_accept()[1:] >= 0).all()          # every state but 0 can still accept
    for s in ["", "c", "abac", "aab", "b", "xb", "é" * 30 + "b", "a" * 30 + "b", '"ab"', '"\\"', '"\\"x"', '"abcdef"']:
        assert pruned.fullmatch(s) == minimal.fullmatch(s) == (re.fullmatch(pattern, s) is not None), s


# ---------------------------------------------------------------------------------------------
# refusals: typed, named, fast

REFUSED = [
    ("(a|b)*a(a|b){20}", "DFA states"), (".{0,1000}x.{0,1000}", "DFA states"),
    ("(?:a|aa|aaa|aaaa){0,1000}b", "too complex"), ("(?:.{0,1000}){0,20}", "NFA states"),
    ("a{1001}", "repetition count"), ("a{99999999}", "repetition count"), ("a" * 10_001, "characters"),
    ("(" * 150 + ")" * 150, "nested deeper"), (r"(a)\1", "backreference"), ("(?P<x>a)(?P=x)", "backreference"),
    ("(?=a)a", "lookahead"), ("(?!a)b", "negative lookahead"), ("(?<=a)b", "lookbehind"), ("(?<!a)b", "lookbehind"),
    ("a^b", "anchor '^'"), ("a$b", "anchor '$'"), (r"\bfoo", "word boundary"), (r"\Afoo", "anchor \\A"),
    ("(?i)abc", "inline flags"), (r"\p{L}", "Unicode property"), ("a**", "multiple repeat"), ("a{2}{3}", "multiple repeat"),
    ("a*+", "possessive"), ("(?>a)", "atomic group"), ("*a", "nothing to repeat"), ("{2}", "nothing to repeat"),
    ("(ab", "missing ')'"), ("ab)", "unbalanced"), ("[ab", "unterminated"), ("[z-a]", "reversed"),
    (r"[\d-z]", "bad character range"), (r"\q", "unknown escape"), ("a{3,2}", "min repeat"),
    (r"\x4", "hex digits"), (r"[^\s\S]", "matches no string"),
]


@pytest.mark.parametrize("pattern,message", REFUSED, ids=[p[:30] for p, _ in REFUSED])
def test_refusals_are_typed_and_fast(pattern, message):
    start = time.perf_counter()
    with pytest.raises(StructuredError, match=re.escape(message)):
        compile_regex(pattern)
    assert time.perf_counter() - start < 3.0      # the worst case (subset-work limit) takes ~0.8 s here
    assert issubclass(StructuredError, ValueError)


def test_limits_are_generous_enough():
    assert compile_regex("[a-z]{0,1000}").n_states <= MAX_DFA_STATES
    assert compile_regex("^(?:a|b)$").fullmatch("a")       # leading ^ and trailing $ ignored
    assert compile_regex(r"a\$").fullmatch("a$")
    with pytest.raises(StructuredError):
        compile_regex(123)


# ---------------------------------------------------------------------------------------------
# JSON schema -> regex

PERSON = {
    "type": "object",
    "title": "Person", "description": "annotations are ignored",
    "properties": {
        "name": {"type": "string", "maxLength": 12, "examples": ["Ann"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 150, "default": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "nickname": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
    },
    "required": ["name"],
}
REFS = {
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                        "required": ["x", "y"]}},
    "definitions": {"Color": {"enum": ["red", "green"]}},
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/Point"}, "b": {"$ref": "#/$defs/Point"},
                   "c": {"$ref": "#/definitions/Color"}},
    "required": ["a", "b"],
}
CASES = [
    (PERSON,
     [{"name": "A"}, {"name": "Bo", "age": 0, "tags": []}, {"name": 'é"\\\n', "age": 150, "tags": ["x", "y", "z"],
                                                             "nickname": None}, {"name": "", "nickname": "n"}],
     [{}, {"name": 1}, {"name": "a", "extra": 1}, {"name": "a", "age": 151}, {"name": "a", "age": -1},
      {"name": "a", "age": 1.5}, {"name": "a", "tags": ["1", "2", "3", "4"]}, [], {"name": "a" * 13}, "x", None]),
    ({"enum": ["red", "green", 3, None, True, [1, 2], {"a": 1}]},
     ["red", "green", 3, None, True, [1, 2], {"a": 1}], ["blue", 4, False, [1], {"a": 2}]),
    ({"const": "x"}, ["x"], ["y", 1]),
    ({"type": "string", "enum": ["a", 1, "b"]}, ["a", "b"], [1, "c"]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
     [[1, 2], [1, -2, 3, 4]], [[1], [1, 2, 3, 4, 5], [1, "2"], {}]),
    ({"type": "number"}, [0, -1.5, 1e10, 2.5e-3, 7], ["1", True, None]),
    ({"type": "boolean"}, [True, False], [0, "true"]),
    ({"type": "null"}, [None], [0, "null"]),
    ({"type": ["string", "null"]}, ["s", None], [1]),
    ({"type": "string", "minLength": 2, "maxLength": 4}, ["ab", "abcd", "é中x"], ["a", "abcde"]),
    ({"type": "string", "pattern": r"^[A-Z]{2}-\d{3}$"}, ["AB-123"], ["AB-12", "ab-123", "xAB-123"]),
    ({"type": "string", "pattern": "fo+"}, ["xfooy", "fo"], ["f", "of"]),
    ({"type": "string", "pattern": '^a"b\\\\c$'}, ['a"b\\c'], ["ab\\c"]),
    ({"type": "string", "format": "date"}, ["2024-02-29", "2023-12-31", "2000-02-29"],
     ["2023-02-29", "2023-13-01", "2023-04-31", "1900-02-29", "0000-01-01"]),
    ({"type": "string", "format": "date-time"}, ["2024-01-01T12:00:00Z", "2024-01-01T23:59:59.123+05:30"],
     ["2024-01-01 12:00:00Z", "2024-01-01T24:00:00Z", "2024-01-01T12:00:00"]),
    ({"type": "string", "format": "uuid"}, [str(uuid.UUID(int=12345)), "A" * 8 + "-1234-1234-1234-" + "b" * 12],
     ["1234", "g" * 8 + "-1234-1234-1234-" + "b" * 12]),
    (REFS, [{"a": {"x": 1, "y": 2.5}, "b": {"x": 0, "y": 0}, "c": "red"}], [{"a": {"x": 1}, "b": {"x": 0, "y": 0}}]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, [{}, {"a": 1, "b": 2}], [{"a": "x"}, []]),
    ({"type": "object"}, [{}, {"a": [1, {"b": None}], "c": "d"}], [[], "x"]),
    ({"type": "object", "additionalProperties": False}, [{}], [{"a": 1}]),
    ({}, [1, "x", None, [1, [2]], {"a": {"b": [3]}}], []),
    ({"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 10}, [-2, 0, 9], [-3, 10, 100, 2.5]),
    ({"allOf": [{"type": "integer"}]}, [1], ["1"]),
    ({"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                 "required": ["kind", "x"]},
                {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "string"}},
                 "required": ["kind", "y"]}]},
     [{"kind": "a", "x": 1}, {"kind": "b", "y": "s"}], [{"kind": "a", "y": "s"}, {"kind": "c", "x": 1}]),
]
STYLES = [{"separators": (",", ":"), "ensure_ascii": False}, {"ensure_ascii": False}, {"indent": 2, "ensure_ascii": False},
          {"indent": 4}]


@pytest.mark.parametrize("schema,valid,invalid", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_schema_accepts_valid_and_rejects_invalid(schema, valid, invalid):
    dfa = build_dfa(schema_to_tree(schema))
    for instance in valid:
        assert conforms(instance, schema, schema), instance          # the test's own validator agrees
        for style in STYLES:
            assert dfa.fullmatch(json.dumps(instance, **style)), (instance, style)
    for instance in invalid:
        assert not conforms(instance, schema, schema), instance
        for style in STYLES[:2]:
            assert not dfa.fullmatch(json.dumps(instance, **style)), (instance, style)


def test_whitespace_policy_and_property_order():
    dfa = build_dfa(schema_to_tree(PERSON))
    assert dfa.fullmatch('{ "name" : "a" }')                 # one space anywhere between tokens
    assert dfa.fullmatch('{\n' + ' ' * 16 + '"name": "a"\n}')   # a newline and up to 16 spaces
    assert not dfa.fullmatch('{\n' + ' ' * 17 + '"name": "a"}')
    assert not dfa.fullmatch('{  "name": "a"}')               # two spaces: not a style json.dumps writes
    assert not dfa.fullmatch(' {"name": "a"}') and not dfa.fullmatch('{"name": "a"}\n')   # nothing around the value
    assert not dfa.fullmatch('{"age": 3, "name": "a"}')       # properties in the schema's order only
    assert dfa.fullmatch(r'{"name": "\u00e9\/\t"}')            # every JSON string escape
    assert not dfa.fullmatch('{"name": "a\tb"}')              # raw control characters are not JSON
    assert not dfa.fullmatch(r'{"name": "\x41"}')


def test_json_object_mode_depth():
    dfa = compile_regex(json_object_regex(), max_chars=1 << 20)

    def nested(depth):
        value = 1
        for i in range(depth - 1):
            value = {"k": value} if i % 2 else [value]
        return {"top": value}

    for depth in range(1, JSON_OBJECT_DEPTH + 1):
        assert dfa.fullmatch(json.dumps(nested(depth))), depth
    assert not dfa.fullmatch(json.dumps(nested(JSON_OBJECT_DEPTH + 1)))
    for text in ['{}', '{"a": "b\\n", "c": [1, 2.5e-3, true, false, null, {}], "d": {"e": []}}']:
        assert dfa.fullmatch(text)
    for text in ['[]', '"x"', '{"a"}', '{"a": 1,}', '{"a": 01}', '{a: 1}', "{'a': 1}", '{"a": NaN}']:
        assert not dfa.fullmatch(text), text


UNSUPPORTED = [
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "number", "minimum": 0}, "minimum"),
    ({"type": "integer", "multipleOf": 2}, "multipleOf"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "prefixItems": [{}]}, "prefixItems"),
    ({"type": "array", "items": [{}]}, "tuple"),
    ({"type": "array", "contains": {}}, "contains"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "string", "format": "email"}, "format 'email'"),
    ({"type": "string", "maxLength": 5000}, "maxLength"),
    ({"type": "string", "pattern": "(?=a)"}, "lookahead"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"if": {}, "then": {}}, "unsupported keyword"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf"),
    ({"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, "recursive $ref"),
    ({"$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/B"}}, "B": {"anyOf": [{"$ref": "#/$defs/A"}]}},
      "$ref": "#/$defs/A"}, "recursive $ref"),
    ({"type": "object", "properties": {"self": {"$ref": "#"}}}, "recursive $ref"),
    ({"$ref": "https://example.com/schema.json"}, "local $ref"),
    ({"$ref": "#/$defs/Missing"}, "points to nothing"),
    ({"$ref": "#/$defs/A", "type": "string", "$defs": {"A": {}}}, "next to $ref"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "required properties missing"),
    ({"type": "date"}, "type must be"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"),
    ({"enum": ["a"], "type": "integer"}, "no value"),
    ({"type": "string", "minLength": -1}, "non-negative"),
    ({"nullable": True, "type": "string"}, "nullable"),
    (False, "matches nothing"),
]


@pytest.mark.parametrize("schema,message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_schema_refusals_name_the_keyword(schema, message):
    with pytest.raises(StructuredError, match=re.escape(message)):
        build_dfa(schema_to_tree(schema))


def test_many_optional_properties_stay_linear():
    """40 optional properties: the regex text spells them out quadratically, the NFA does not."""
    schema = {"type": "object", "properties": {f"f{i}": {"type": ["string", "integer", "null"][i % 3]} for i in range(40)}}
    start = time.perf_counter()
    dfa = build_dfa(schema_to_tree(schema))
    assert time.perf_counter() - start < 5
    chosen = {f"f{i}": ["s", 1, None][i % 3] for i in range(40) if i % 7 == 3}
    assert dfa.fullmatch(json.dumps(chosen)) and dfa.fullmatch("{}")
    assert not dfa.fullmatch('{"f3": null, "f1": 1}')      # out of order
    small = {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}, "required": ["b"]}
    text_dfa = compile_regex(schema_to_regex(small), max_chars=1 << 20)
    for text in ['{"b":1}', '{"a":1,"b":2,"c":3}', '{"b":2,"c":3}', '{"a":1}', '{}', '{"a":1,"c":3}', '{"b":1,}']:
        assert text_dfa.fullmatch(text) == build_dfa(schema_to_tree(small)).fullmatch(text) == \
            (re.fullmatch(schema_to_regex(small), text) is not None), text


@SETTINGS
@given(lo=st.one_of(st.none(), st.integers(-3000, 3000)), span=st.integers(0, 5000),
       probes=st.lists(st.integers(-20_000, 20_000), max_size=40), unbounded_hi=st.booleans())
def test_int_range_regex(lo, span, probes, unbounded_hi):
    hi = None if unbounded_hi else (span if lo is None else lo + span)
    pattern = re.compile(int_range_regex(lo, hi))
    edges = [v for v in (lo, hi) if v is not None]
    for n in probes + [e + d for e in edges for d in (-1, 0, 1)] + [0, -1, 1]:
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert (pattern.fullmatch(str(n)) is not None) == inside, (lo, hi, n)
    assert not pattern.fullmatch("-0") and not pattern.fullmatch("007")


def test_jsonschema_agrees_where_installed():
    jsonschema = pytest.importorskip("jsonschema")
    for schema, valid, invalid in CASES:
        for instance in valid:
            jsonschema.validate(instance, schema, format_checker=jsonschema.FormatChecker())
        for instance in invalid:
            if schema.get("format") in ("date-time", "uuid"):
                continue              # format checkers that need optional packages here
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(instance, {**schema, "additionalProperties": False} if schema is PERSON else schema,
                                    format_checker=jsonschema.FormatChecker())


# ---------------------------------------------------------------------------------------------
# masks over a hand-made vocabulary: exact

TINY = [b"a", b"b", b"ab", b"ba", b"", b"abc", b"c", b"\xc3", b"\xa9", b"\xc3\xa9", b"aa"]   # id 4: eos


@pytest.fixture(scope="module")
def tiny():
    return TokenVocabulary(TINY, eos_token_ids={4}, vocab_size=14)


def ids_of(mask):
    return np.flatnonzero(mask).tolist()


def test_exact_masks(tiny):
    m = TokenMatcher(compile_constraint("regex", "a+b", tiny))
    assert m.allowed_mask().shape == (14,) and m.allowed_mask().dtype == bool
    assert ids_of(m.allowed_mask()) == [0, 2, 10]             # a, ab, aa (not b, ba, abc, eos, padding)
    m.advance(0)
    assert ids_of(m.allowed_mask()) == [0, 1, 2, 10]
    m.advance(1)
    assert m.is_accepting and m.is_finished
    assert ids_of(m.allowed_mask()) == [4]                   # only eos
    m.advance(4)
    assert ids_of(m.allowed_mask()) == [] and m.is_finished
    with pytest.raises(StructuredError, match="ended"):
        m.advance(0)

    m = TokenMatcher(compile_constraint("regex", "é+", tiny))
    assert ids_of(m.allowed_mask()) == [7, 9]                 # the first byte alone, or the whole character
    m.advance(7)
    assert ids_of(m.allowed_mask()) == [8] and not m.is_accepting
    m.advance(8)
    assert ids_of(m.allowed_mask()) == [4, 7, 9] and m.is_accepting and not m.is_finished


def test_advance_refuses_what_the_mask_refuses(tiny):
    compiled = compile_constraint("choice", ["ab", "abc"], tiny)
    m = TokenMatcher(compiled)
    for bad, message in ((1, "not allowed"), (4, "eos token 4 before"), (13, "not allowed"), (99, "not allowed"),
                         (-1, "not allowed")):
        with pytest.raises(StructuredError, match=message):
            m.advance(bad)
    fork = m.copy()
    m.advance(2)
    assert m.is_accepting and not m.is_finished and ids_of(m.allowed_mask()) == [4, 6]
    assert fork.state == compiled.dfa.start                  # the copy did not move
    fork.advance(5)
    assert fork.is_finished


def test_vocabulary_details(tiny):
    assert tiny.token_bytes[4] == b"" and tiny.vocab_size == 14 and not tiny.is_text[11:].any()
    short = TokenVocabulary(TINY, eos_token_ids={4, 50}, vocab_size=3)      # truncated; eos ids past it dropped
    assert short.token_bytes == [b"a", b"b", b"ab"] and short.eos_token_ids == frozenset()
    blanked = TokenVocabulary([b"x", b"</s>"], eos_token_ids={1})           # an eos id with text: never text
    assert ids_of(TokenMatcher(compile_constraint("regex", "x|</s>", blanked)).allowed_mask()) == [0]
    m = TokenMatcher(compile_constraint("regex", "a?", tiny))
    assert ids_of(m.allowed_mask()) == [0, 4]                 # the empty output accepts: eos allowed at once
    dead = TokenMatcher(compile_constraint("regex", "zz", tiny))
    assert dead.is_dead and ids_of(dead.allowed_mask()) == []   # no token spells z


def test_compile_cache_is_keyed_by_kind_and_spec(tiny, monkeypatch):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    first = compile_constraint("json_schema", schema, tiny)
    assert compile_constraint("json_schema", json.loads(json.dumps(schema)), tiny) is first
    reordered = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert compile_constraint("json_schema", reordered, tiny) is not first       # order is part of the output
    assert compile_constraint("regex", "ab", tiny) is not compile_constraint("choice", ["ab"], tiny)
    assert first.regex == constraint_regex("json_schema", schema)
    for kind, spec, message in (("yaml", "x", "unknown constraint kind"), ("regex", ["a"], "needs a string"),
                                ("choice", [], "non-empty"), ("choice", "ab", "non-empty"), ("json_schema", "{}", "schema"),
                                ("json_schema", {"a": float("nan")}, "not plain JSON"), ("json_object", {"a": 1}, "no spec")):
        with pytest.raises(StructuredError, match=message):
            compile_constraint(kind, spec, tiny)
    monkeypatch.setattr(token_mask, "MAX_COMPILED", 4)
    for i in range(10):
        compile_constraint("regex", f"a{{{i}}}", tiny)
    assert len(tiny._compiled) == 4


def test_mask_cache_is_bounded(tiny, monkeypatch):
    compiled = compile_constraint("regex", "[abc]{0,40}", tiny)
    monkeypatch.setattr(token_mask, "MASK_CACHE_BYTES", 16)
    state = compiled.dfa.start
    for _ in range(30):
        compiled.allowed(state)
        state = compiled.dfa.walk(state, b"a")
    info = compiled.cache_info()
    assert info["bytes"] <= 16 and info["states_cached"] <= 8
    compiled.allowed(state)
    before = compiled.hits
    compiled.allowed(state)
    assert compiled.hits == before + 1


# ---------------------------------------------------------------------------------------------
# the default model's tokenizer: speed, real masks, random walks

@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from engine.text.tokenizer import load_tokenizer
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocabulary.from_tokenizer(tokenizer, vocab_size=tokenizer.vocab_size + 64)


def test_vocabulary_from_tokenizer(tokenizer):
    start = time.perf_counter()
    vocab = TokenVocabulary.from_tokenizer(tokenizer, vocab_size=49152 + 32, eos_token_ids={2})
    elapsed = time.perf_counter() - start
    assert TokenVocabulary.from_tokenizer(tokenizer, vocab_size=49152 + 32, eos_token_ids={2}) is vocab   # cached
    assert elapsed < 5, elapsed
    assert vocab.vocab_size == 49184 and vocab.eos_token_ids == {2}
    assert not vocab.is_text[list(tokenizer.special_token_ids)].any() and not vocab.is_text[49152:].any()
    token = tokenizer.encode(" hello")[0]
    assert vocab.token_bytes[token] == tokenizer.token_bytes([token]) != b""
    print(f"\nTokenVocabulary.from_tokenizer: {elapsed * 1e3:.0f} ms, {vocab}")


def test_mask_build_time(vocab, tokenizer):
    """The numbers in token_mask.py's docstring come from here (pytest -s prints them)."""
    compiled = compile_constraint("json_schema", PERSON, vocab)
    m = TokenMatcher(compiled)
    for token in tokenizer.encode('{"name": "'):
        m.advance(token)
    free_string = m.state                                    # inside a free string: almost every token
    timings = {}
    for name, state in (("structural (start)", compiled.dfa.start), ("free string", free_string)):
        compiled._masks.pop(state, None)
        t0 = time.perf_counter()
        mask = compiled.allowed(state)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(100):
            compiled.allowed(state)
        cached = (time.perf_counter() - t0) / 100
        timings[name] = (cold, cached, int(mask.sum()))
        assert cold < 0.2 and cached < 0.002
    print("\nmask build over", vocab.vocab_size, "ids:",
          "; ".join(f"{n}: cold {c * 1e3:.2f} ms, cached {k * 1e6:.0f} us, {a} allowed" for n, (c, k, a) in timings.items()))
    assert timings["free string"][2] > 40_000


def test_natural_tokenization_is_allowed(vocab, tokenizer):
    """The tokenizer's own encoding of a valid output passes the masks token by token, and ends accepting."""
    cases = [("json_schema", PERSON, {"name": "Zoë", "age": 41, "tags": ["a", "b"], "nickname": None}),
             ("json_schema", REFS, {"a": {"x": 1.5, "y": -2}, "b": {"x": 0, "y": 1e-3}, "c": "green"}),
             ("json_object", None, {"k": [1, {"deep": "yes"}], "ü": "√2 ≈ 1.414"})]
    for kind, spec, instance in cases:
        for style in STYLES[:3]:
            text = json.dumps(instance, **style)
            m = TokenMatcher(compile_constraint(kind, spec, vocab))
            for token in tokenizer.encode(text):
                assert m.allowed_mask()[token], (text, tokenizer.decode([token]))
                m.advance(token)
            assert m.is_accepting and m.allowed_mask()[2]


RANDOM_WALKS = [
    ("regex", r"[a-z]{3,8}@[a-z]{2,5}\.(?:com|org)"),
    ("regex", r"(?:\d{1,3}\.){3}\d{1,3}"),
    ("regex", r"[αβγ]{2,4}-é+[^\x00-\x7f]{0,3}"),
    ("choice", ["yes", "no", "maybe so", "ÿes", "n"]),
    ("json_schema", PERSON),
    ("json_schema", REFS),
    ("json_schema", {"type": "array", "items": {"enum": ["x", 1, None, {"k": [True]}]}, "minItems": 1, "maxItems": 4}),
    ("json_object", None),
]


def random_walk(compiled, vocab, rng, not_text, budget=250):
    """Random allowed tokens until eos or the budget: mostly uniform, sometimes the sampled token that
    gets closest to acceptance (so most walks end). Returns (ids, ended with eos)."""
    m = TokenMatcher(compiled)
    distance = compiled.dfa.distances_to_accept()
    eos = sorted(vocab.eos_token_ids)
    ids: list[int] = []
    for _ in range(budget):
        mask = m.allowed_mask()
        assert mask[eos].all() == m.is_accepting and not mask[not_text].any()
        text_ids = np.flatnonzero(mask & vocab.is_text)
        assert text_ids.size or m.is_accepting, "stuck in a live state"
        if m.is_accepting and (not text_ids.size or rng.random() < 0.3):
            m.advance(eos[0])
            return ids, True
        if len(ids) >= 4 and rng.random() < 0.35:
            sample = rng.choice(text_ids, size=min(64, text_ids.size), replace=False)
            token = int(min(sample, key=lambda t: distance[compiled.dfa.walk(m.state, vocab.token_bytes[t])]))
        else:
            token = int(rng.choice(text_ids))
        m.advance(token)
        ids.append(token)
    return ids, False


@pytest.mark.parametrize("kind,spec", RANDOM_WALKS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(RANDOM_WALKS)])
def test_random_walks_produce_valid_output(vocab, tokenizer, kind, spec):
    compiled = compile_constraint(kind, spec, vocab)
    rng = np.random.default_rng(zlib.crc32(json.dumps([kind, spec]).encode()))
    not_text = np.flatnonzero(~vocab.is_text)
    not_text = not_text[~np.isin(not_text, sorted(vocab.eos_token_ids))]     # special tokens, padding ids
    ended = 0
    for _ in range(8):
        ids, done = random_walk(compiled, vocab, rng, not_text)
        data = b"".join(vocab.token_bytes[i] for i in ids)
        assert tokenizer.token_bytes(ids) == data
        if not done:
            assert compiled.dfa.walk(compiled.dfa.start, data) != 0       # a live prefix
            continue
        ended += 1
        text = data.decode("utf-8")                                      # complete UTF-8: the DFA is over characters
        if kind == "regex":
            assert re.fullmatch(spec, text, re.ASCII), text
        elif kind == "choice":
            assert text in spec
        else:
            value = json.loads(text)
            if kind == "json_object":
                assert isinstance(value, dict) and depth_of(value) <= JSON_OBJECT_DEPTH, text
            else:
                assert conforms(value, spec, spec), text
    assert ended >= 5, f"only {ended} of 8 walks reached eos"


# ---------------------------------------------------------------------------------------------
# a tiny validator for the subset the tests use (jsonschema is not a dependency)

def conforms(value, schema, root) -> bool:
    if schema is True or schema == {}:
        return True
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        return conforms(value, target, root)
    if "anyOf" in schema:
        return any(conforms(value, s, root) for s in schema["anyOf"])
    if "oneOf" in schema:
        return sum(conforms(value, s, root) for s in schema["oneOf"]) == 1
    if "allOf" in schema:
        return all(conforms(value, s, root) for s in schema["allOf"])
    if "enum" in schema or "const" in schema:
        options = schema.get("enum", [schema.get("const")])
        if not any(type(value) is type(o) and value == o or (is_number(value) and is_number(o) and value == o)
                   for o in options):
            return False
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(has_type(value, t) for t in types):
            return False
    if isinstance(value, dict):
        properties = schema.get("properties")
        if properties is not None:
            if any(k not in properties for k in value) or any(r not in value for r in schema.get("required", [])):
                return False
            if not all(conforms(v, properties[k], root) for k, v in value.items()):
                return False
        additional = schema.get("additionalProperties", True)
        if properties is None and additional is not True and (additional is False and value or
                                                              not all(conforms(v, additional, root) for v in value.values())):
            return False
    if isinstance(value, list):
        items = schema.get("items", True)
        if not all(conforms(v, items, root) for v in value):
            return False
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            return False
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return False
        if "format" in schema and not format_ok(value, schema["format"]):
            return False
    if is_number(value) and "enum" not in schema:
        for key, ok in (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
                        ("exclusiveMinimum", lambda b: value > b), ("exclusiveMaximum", lambda b: value < b)):
            if key in schema and not ok(schema[key]):
                return False
    return True


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def has_type(value, t) -> bool:
    return {"object": isinstance(value, dict), "array": isinstance(value, list), "string": isinstance(value, str),
            "integer": isinstance(value, int) and not isinstance(value, bool), "number": is_number(value),
            "boolean": isinstance(value, bool), "null": value is None}[t]


def format_ok(value: str, fmt: str) -> bool:
    try:
        if fmt == "date":
            return len(value) == 10 and datetime.date.fromisoformat(value) is not None
        if fmt == "date-time":
            m = re.fullmatch(r"(\d{4}-\d\d-\d\d)[Tt](\d\d):(\d\d):(\d\d)(\.\d+)?(?:[Zz]|[+-](\d\d):(\d\d))", value)
            return bool(m) and format_ok(m[1], "date") and int(m[2]) < 24 and int(m[3]) < 60 and int(m[4]) < 60 \
                and (m[6] is None or int(m[6]) < 24 and int(m[7]) < 60)
        if fmt == "uuid":
            return len(value) == 36 and uuid.UUID(value) is not None
    except ValueError:
        return False
    return True


def depth_of(value) -> int:
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0
