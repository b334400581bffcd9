"""Chapter 17 exercises: the token mask of a DFA state, and a structured reply through the server.

`check_token_mask(fn)` holds your mask (which tokens may come next in a DFA state) to the engine's
own, engine.structured's CompiledConstraint.allowed: first on crafted cases over a small vocabulary
whose tokens are the classic traps (a token that dies on its second byte, eos, tokens with no bytes,
pieces of a UTF-8 character), then on states of real constraints over the default model's 49,152-token
vocabulary, then on seeded random vocabularies. A wrong mask is matched against the classic mistakes
by *which* tokens it gets wrong (eos only, empty tokens only, partial characters only, ...).
`check_structured_reply(fn)` runs your OpenAI-client function against the engine's server and
validates what it returns against the schemas asked for.

Also the chapter's helpers: `byte_table` (a DFA's table per byte), `show_dfa` (its transitions as
byte ranges), `schema_problems` (a small JSON-schema validator for the subset the chapter uses).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable

import numpy as np

Mask = Callable[..., np.ndarray]      # (table, accepting, state, token_bytes, eos_ids) -> bool [V]

SEED = 17


# ----------------------------------------------------------------------------- the chapter's helpers


def byte_table(dfa) -> np.ndarray:
    """int32 [n_states, 256]: table[s, b] is the state after byte b from state s (0: the dead state).
    The engine stores one column per byte *class* (dfa.table, dfa.classes); this spells it out."""
    return np.ascontiguousarray(np.asarray(dfa.table)[:, np.asarray(dfa.classes)], dtype=np.int32)


def _byte_text(b: int) -> str:
    c = chr(b)
    if 0x21 <= b <= 0x7E and c not in "\\-":
        return c
    return {0x20: "' '", 0x5C: "\\\\", 0x2D: "-", 0x0A: "\\n"}.get(b, f"\\x{b:02x}")


def byte_ranges(bytes_: list[int]) -> str:
    """[48, 49, ..., 57, 65] -> '0-9 A': sorted byte values as compact ranges."""
    out, i = [], 0
    while i < len(bytes_):
        j = i
        while j + 1 < len(bytes_) and bytes_[j + 1] == bytes_[j] + 1:
            j += 1
        lo, hi = bytes_[i], bytes_[j]
        out.append(_byte_text(lo) if lo == hi else f"{_byte_text(lo)}-{_byte_text(hi)}")
        i = j + 1
    return " ".join(out)


def show_dfa(dfa, max_states: int = 12) -> None:
    """Print each live state's transitions, bytes grouped into ranges; '(accepts)' where a match may end."""
    table = byte_table(dfa)
    print(f"{dfa.n_states} states (0 is dead), start {dfa.start}, {dfa.n_classes} byte classes")
    for s in range(1, min(dfa.n_states, max_states + 1)):
        moves: dict[int, list[int]] = {}
        for b in range(256):
            if table[s, b]:
                moves.setdefault(int(table[s, b]), []).append(b)
        edges = ",  ".join(f"[{byte_ranges(bs)}] -> {t}" for t, bs in sorted(moves.items(), key=lambda kv: kv[1][0]))
        flags = (" (start)" if s == dfa.start else "") + (" (accepts)" if dfa.accepting[s] else "")
        print(f"  state {s}{flags}: {edges or 'no moves'}")
    if dfa.n_states > max_states + 1:
        print(f"  ... {dfa.n_states - max_states - 1} more states")


def walk_bytes(table: np.ndarray, state: int, data: bytes) -> list[int]:
    """The states after each byte of `data` from `state` (stops at the dead state 0)."""
    states = []
    for b in data:
        state = int(table[state, b])
        states.append(state)
        if state == 0:
            break
    return states


_JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is_type(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, float) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES.get(t, ()))


def schema_problems(value, schema, where: str = "$", root=None) -> list[str]:
    """What is wrong with `value` under `schema` (empty: valid). The subset of JSON Schema this chapter
    uses: type, enum, const, properties, required, additionalProperties, items, minItems, maxItems,
    minLength, maxLength, pattern, minimum, maximum, exclusiveMinimum, exclusiveMaximum, anyOf, oneOf,
    allOf and local $ref; other keywords are not checked."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [f"{where}: the schema false allows nothing"]
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/") if schema["$ref"] != "#" else []:
            target = target[part.replace("~1", "/").replace("~0", "~")]
        return schema_problems(value, target, where, root)
    problems: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, t) for t in names):
            return [f"{where}: {json.dumps(value)[:40]} is not of type {types}"]
    if "enum" in schema and not any(_same(value, v) for v in schema["enum"]):
        problems.append(f"{where}: {json.dumps(value)[:40]} is not one of {schema['enum']}")
    if "const" in schema and not _same(value, schema["const"]):
        problems.append(f"{where}: {json.dumps(value)[:40]} is not {json.dumps(schema['const'])}")
    for key, combine in (("anyOf", any), ("allOf", all)):
        if key in schema and not combine(not schema_problems(value, s, where, root) for s in schema[key]):
            problems.append(f"{where}: matches {'none' if key == 'anyOf' else 'not all'} of the {key} schemas")
    if "oneOf" in schema and sum(not schema_problems(value, s, where, root) for s in schema["oneOf"]) != 1:
        problems.append(f"{where}: does not match exactly one of the oneOf schemas")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        problems += [f"{where}: the required key {k!r} is missing" for k in schema.get("required", []) if k not in value]
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                problems += schema_problems(item, properties[key], f"{where}.{key}", root)
            elif extra is False:
                problems.append(f"{where}: the key {key!r} is not allowed (additionalProperties: false)")
            elif isinstance(extra, dict):
                problems += schema_problems(item, extra, f"{where}.{key}", root)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            problems.append(f"{where}: {len(value)} items, outside minItems/maxItems")
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                problems += schema_problems(item, schema["items"], f"{where}[{i}]", root)
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            problems.append(f"{where}: {len(value)} characters, outside minLength/maxLength")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            problems.append(f"{where}: {value[:40]!r} does not match the pattern {schema['pattern']!r}")
    if _is_type(value, "number"):
        for key, fails in (("minimum", lambda v, b: v < b), ("maximum", lambda v, b: v > b),
                           ("exclusiveMinimum", lambda v, b: v <= b), ("exclusiveMaximum", lambda v, b: v >= b)):
            if key in schema and fails(value, schema[key]):
                problems.append(f"{where}: {value} breaks {key} {schema[key]}")
    return problems


def _same(a, b) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) if isinstance(a, (dict, list)) else a == b


# ----------------------------------------------------------------------------- the reference and the classic mistakes


def token_mask_reference(table, accepting, state, token_bytes, eos_ids) -> np.ndarray:
    """The contract, token by token (the engine gets the same answer with one walk down a trie of the
    vocabulary): a text token is allowed iff walking all its bytes from `state` never reaches the dead
    state 0; an eos id iff the state accepts; a token with no bytes never."""
    rows = np.asarray(table).tolist()            # Python ints: a fast inner loop
    mask = np.zeros(len(token_bytes), dtype=bool)
    for i, data in enumerate(token_bytes):
        if not data:
            continue
        s = state
        for b in data:
            s = rows[s][b]
            if s == 0:
                break
        mask[i] = s != 0
    for i in eos_ids:
        mask[i] = bool(accepting[state])
    return mask


def _walk(table, state, data) -> int:
    for b in data:
        state = int(table[state, b])
        if state == 0:
            return 0
    return state


def first_byte_mask(table, accepting, state, token_bytes, eos_ids) -> np.ndarray:
    """A token allowed when its first byte is: the rest of it is never walked."""
    mask = np.array([bool(data) and table[state, data[0]] != 0 for data in token_bytes], dtype=bool)
    mask[list(eos_ids)] = bool(accepting[state])
    return mask


def eos_anywhere_mask(table, accepting, state, token_bytes, eos_ids) -> np.ndarray:
    """eos allowed in every state, as if a request could stop whenever the model likes."""
    mask = token_mask_reference(table, accepting, state, token_bytes, eos_ids)
    mask[list(eos_ids)] = True
    return mask


def eos_never_mask(table, accepting, state, token_bytes, eos_ids) -> np.ndarray:
    """eos never allowed (not text, so never walked)."""
    mask = token_mask_reference(table, accepting, state, token_bytes, eos_ids)
    mask[list(eos_ids)] = False
    return mask


def empty_tokens_mask(table, accepting, state, token_bytes, eos_ids) -> np.ndarray:
    """Every token walked, the ones with no bytes too: walking b"" leaves the state alive."""
    mask = np.array([_walk(table, state, data) != 0 for data in token_bytes], dtype=bool)
    mask[list(eos_ids)] = bool(accepting[state])
    return mask


def whole_characters_mask(table, accepting, state, token_bytes, eos_ids) -> np.ndarray:
    """Tokens that are not valid UTF-8 on their own refused, as if every token held whole characters."""
    mask = token_mask_reference(table, accepting, state, token_bytes, eos_ids)
    mask &= np.array([not data or valid_utf8(data) for data in token_bytes], dtype=bool)
    return mask


def accepting_only_mask(table, accepting, state, token_bytes, eos_ids) -> np.ndarray:
    """A token allowed only when the output is complete after it (it ends in an accepting state)."""
    mask = np.array([bool(data) and bool(accepting[_walk(table, state, data)]) for data in token_bytes], dtype=bool)
    mask[list(eos_ids)] = bool(accepting[state])
    return mask


MISTAKES: dict[str, str] = {
    "first_byte": "checking only the first byte: a token is allowed only if every one of its bytes can be taken, "
                  "one after the other, from the state the previous byte left (b'\",' after a string's last "
                  "character is fine, b'a}' inside a string is not)",
    "eos_anywhere": "allowing eos in a state that does not accept: the request could end with an incomplete output "
                    "(b'{\"name\": \"To'); eos ids are allowed exactly where accepting[state] is true",
    "eos_never": "never allowing eos: when the output is complete (accepting[state]) eos must be allowed, or the "
                 "request cannot end there (at the end of a JSON object, eos is often the only token left)",
    "empty_tokens": "allowing the tokens with no bytes (special tokens such as <|im_start|>): walking b'' leaves the "
                    "state where it is, so a naive walk lets them through; they are not text and never allowed "
                    "(eos aside)",
    "whole_characters": "forgetting multi-byte UTF-8: a token may hold part of a character (SmolLM2 spells 東 as "
                        "b' \\xe6', b'\\x9d', b'\\xb1'), and the DFA works on bytes; walk a token's bytes as they are, "
                        "never refuse (or decode) a token because it is not valid UTF-8 on its own",
    "accepting_only": "allowing only the tokens after which the output is complete: a token must keep the output "
                      "matchable (any state but the dead one 0), not finish it",
}


def valid_utf8(data: bytes) -> bool:
    """Whether a token's bytes are whole UTF-8 characters on their own."""
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ----------------------------------------------------------------------------- exercise 1: the token mask

# A small vocabulary of traps: id -> bytes (b"" for special tokens; id 1 is eos)
TRAPS: list[bytes] = [b"", b"", b"1", b"12", b"1a", b"a", b'"', b'",', b'"}', b"\xc3", b"\xa9", b"\xc3\xa9",
                      b" \xe6", b"\x9d\xb1", b"}", b", ", b"a}", b"<", b""]
TRAPS_EOS = {1}
TRAP_PATTERN = '"(é|東|[0-9a-z ])*"(, |})'


def _crafted_cases():
    """(what the case is, pattern, bytes that lead from the start to the state) over TRAPS."""
    return [
        ("[0-9]+ at its start (b'1a' dies on its second byte)", "[0-9]+", b""),
        ("[0-9]+ after b'1' (a complete match: eos may come, and more digits)", "[0-9]+", b"1"),
        (f"{TRAP_PATTERN} at its start (only b'\"' opens it)", TRAP_PATTERN, b""),
        (f"{TRAP_PATTERN} inside the string (b'\"' may close it, b'a}}' may not)", TRAP_PATTERN, b'"1'),
        (f"{TRAP_PATTERN} after b'\\xc3' (halfway through é: only its second byte)", TRAP_PATTERN, b'"1\xc3'),
        (f"{TRAP_PATTERN} after the closing quote", TRAP_PATTERN, b'"a"'),
        (f"{TRAP_PATTERN} complete (only eos is left)", TRAP_PATTERN, b'"a"}'),
    ]


PET_SCHEMA = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "species": {"enum": ["cat", "dog", "bird"]},
                             "age": {"type": "integer", "minimum": 0, "maximum": 30}},
              "required": ["name", "species", "age"]}


def _real_cases():
    """(what the case is, kind, spec, bytes that lead from the start to the state)."""
    pet = '{"name": "Tomé", "species": "cat", "age": 3}'.encode()
    cut = pet.index("é".encode())
    return [
        ("the pet schema at its start", "json_schema", PET_SCHEMA, b""),
        ("the pet schema after b'{\"name\": \"' (a free string)", "json_schema", PET_SCHEMA, pet[:10]),
        ("the pet schema halfway through é (after b'\\xc3')", "json_schema", PET_SCHEMA, pet[:cut + 1]),
        ("the pet schema after b'\"age\": ' (an integer 0..30)", "json_schema", PET_SCHEMA, pet[:-2]),
        ("the pet schema complete (only eos)", "json_schema", PET_SCHEMA, pet),
        ("-?[0-9]+(\\.[0-9]+)? after b'3' (complete, or more)", "regex", r"-?[0-9]+(\.[0-9]+)?", b"3"),
        ("the choice yes / no / maybe at its start", "choice", ["yes", "no", "maybe"], b""),
        ("(café|naïve|東京) after b'caf'", "regex", "(café|naïve|東京)", b"caf"),
    ]


RANDOM_PATTERNS = ['"(é|東|[0-9a-z ])*"(, |})', "[0-9]{1,3}(,[0-9]{1,3})*", "(ab|a)*b?é", "[^\"]{0,6}\""]
RANDOM_PIECES = [c.encode() for c in '0123456789abz",} '] + ["é".encode(), "東".encode()] \
    + [b"\xc3", b"\xa9", b"\xe6", b"\x9d", b"\xb1", b"\x9d\xb1"]


def random_vocabulary(rng: np.random.Generator, size: int = 300) -> tuple[list[bytes], set[int]]:
    """`size` tokens of 1-4 pieces (ASCII bytes, whole and split UTF-8 characters), a few with no
    bytes, one of them eos."""
    tokens = [b"".join(RANDOM_PIECES[j] for j in rng.integers(0, len(RANDOM_PIECES), size=rng.integers(1, 5)))
              for _ in range(size)]
    empty = rng.choice(size, size=4, replace=False)
    for i in empty:
        tokens[int(i)] = b""
    return tokens, {int(empty[0])}


def _show(data: bytes) -> str:
    return repr(data) if data else "b'' (no bytes)"


def _explain(table, accepting, state, token_bytes, eos_ids, i: int, allowed: bool) -> str:
    """Why token i is (not) allowed in `state`, as the walk of its bytes."""
    data = token_bytes[i]
    if i in eos_ids:
        return f"eos (id {i}), which {'is' if allowed else 'is not'} allowed: state {state} " \
               f"{'accepts' if accepting[state] else 'does not accept'}"
    if not data:
        return f"id {i}, a token with no bytes (a special token)"
    steps = ", ".join(f"{_byte_text(b)} -> {s}" for b, s in zip(data, walk_bytes(table, state, data)))
    end = _walk(table, state, data)
    return f"id {i} {_show(data)}: from state {state}, {steps}" + (" (dead)" if end == 0 else "")


def _diagnose(got, want, table, accepting, state, token_bytes, eos_ids) -> str | None:
    """Which classic mistake the wrong tokens point to, or None."""
    V = len(token_bytes)
    eos = np.zeros(V, bool)
    eos[list(eos_ids)] = True
    empty = np.array([not b for b in token_bytes]) & ~eos
    partial = np.array([bool(b) and not valid_utf8(b) for b in token_bytes])
    first_live = np.array([bool(b) and table[state, b[0]] != 0 for b in token_bytes])
    ends = np.array([_walk(table, state, b) if b else 0 for b in token_bytes])
    extra, missing = got & ~want, want & ~got
    if extra.any() and not (extra & ~eos).any() and not missing.any():
        return "eos_anywhere"
    if missing.any() and not (missing & ~eos).any() and not extra.any():
        return "eos_never"
    if extra.any() and not (extra & ~empty).any():
        return "empty_tokens"
    if missing.any() and not (missing & ~partial).any():
        return "whole_characters"
    if extra.any() and not (extra & ~(first_live & ~eos & ~empty)).any():
        return "first_byte"
    if missing.any() and not (missing & ~(~eos & (ends != 0) & ~accepting[ends])).any():
        return "accepting_only"
    return None


def _compare(title, where, fn, table, accepting, state, token_bytes, eos_ids, want) -> bool | None:
    """One call of fn against the engine's mask `want`: True (equal), False (a verdict was printed),
    None (not attempted yet)."""
    name = getattr(fn, "__name__", "fn")
    V = len(token_bytes)
    try:
        got = fn(table.copy(), accepting.copy(), state, list(token_bytes), set(eos_ids))
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
        return None
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] {title}: {name}(...) on {where}, state {state}, raised {type(e).__name__}: {e}")
        return False
    arr = np.asarray(got) if isinstance(got, (np.ndarray, list, tuple)) else None
    if arr is None or arr.dtype != bool or arr.shape != (V,):
        shown = f"an array of shape {arr.shape} and dtype {arr.dtype}" if arr is not None else repr(got)[:60]
        print(f"[x] {title}: {name}(...) on {where} returned {shown}: return a NumPy bool array with one entry "
              f"per token ({V:,} here), e.g. mask = np.zeros(len(token_bytes), dtype=bool)")
        return False
    if np.array_equal(arr, want):
        return True
    extra, missing = np.flatnonzero(arr & ~want), np.flatnonzero(want & ~arr)
    parts = []
    if extra.size:
        parts.append(f"allows {extra.size:,} token(s) the engine's mask refuses, e.g. "
                     + _explain(table, accepting, state, token_bytes, eos_ids, int(extra[0]), False))
    if missing.size:
        parts.append(f"refuses {missing.size:,} token(s) the engine's mask allows, e.g. "
                     + _explain(table, accepting, state, token_bytes, eos_ids, int(missing[0]), True))
    line = f"[x] {title}: on {where}, state {state}: your mask " + "; and ".join(parts)
    mistake = _diagnose(arr, want, table, accepting, state, token_bytes, eos_ids)
    if mistake:
        line += f" -- it looks like {MISTAKES[mistake]}"
    print(line)
    return False


def _states(kind, spec, vocab, prefixes_or_count, rng=None):
    """(compiled constraint, byte table, accepting, [states]) of a constraint over `vocab`: the states
    that the given byte prefixes lead to, or `count` states drawn with rng."""
    from engine.structured.token_mask import compile_constraint
    compiled = compile_constraint(kind, spec, vocab)
    dfa = compiled.dfa
    table, accepting = byte_table(dfa), np.array(dfa.accepting, dtype=bool)
    if rng is None:
        states = [_walk(table, dfa.start, prefix) for prefix in prefixes_or_count]
    else:
        states = [int(s) for s in rng.choice(np.arange(1, dfa.n_states), size=min(prefixes_or_count, dfa.n_states - 1),
                                             replace=False)]
    return compiled, table, accepting, states


def check_token_mask(fn: Mask) -> bool:
    """fn(table, accepting, state, token_bytes, eos_ids) -> bool [len(token_bytes)], the tokens that may
    come next in DFA `state`, equal to the engine's mask (CompiledConstraint.allowed): on crafted
    states over a vocabulary of traps, on states of real constraints over the default model's
    vocabulary, and on seeded random vocabularies."""
    from engine.structured.token_mask import TokenVocabulary
    title = "token mask"
    traps = TokenVocabulary(TRAPS, TRAPS_EOS)
    crafted = _crafted_cases()
    for what, pattern, prefix in crafted:
        compiled, table, accepting, (state,) = _states("regex", pattern, traps, [prefix])
        ok = _compare(title, f"the trap vocabulary, {what}", fn, table, accepting, state, traps.token_bytes,
                      traps.eos_token_ids, compiled.allowed(state))
        if not ok:
            return False
    import engine
    vocab = TokenVocabulary.from_tokenizer(engine.load_tokenizer(engine.ensure_default_model()))
    real = _real_cases()
    for what, kind, spec, prefix in real:
        compiled, table, accepting, (state,) = _states(kind, spec, vocab, [prefix])
        if not _compare(title, f"SmolLM2's vocabulary, {what}", fn, table, accepting, state, vocab.token_bytes,
                        vocab.eos_token_ids, compiled.allowed(state)):
            return False
    rng = np.random.default_rng(SEED)
    n_random = 0
    for case in range(6):
        tokens, eos = random_vocabulary(rng)
        random_vocab = TokenVocabulary(tokens, eos)
        for pattern in RANDOM_PATTERNS:
            compiled, table, accepting, states = _states("regex", pattern, random_vocab, 3, rng)
            for state in states:
                where = f"random vocabulary {case} (seed {SEED}), pattern {pattern}"
                if not _compare(title, where, fn, table, accepting, state, random_vocab.token_bytes,
                                random_vocab.eos_token_ids, compiled.allowed(state)):
                    return False
                n_random += 1
    print(f"[OK] {title}: your masks equal the engine's on {len(crafted)} crafted states (a token dying on its "
          f"second byte, eos, tokens with no bytes, split UTF-8 characters), {len(real)} states of real "
          f"constraints over SmolLM2's {vocab.vocab_size:,} tokens and {n_random} states of seeded random "
          "vocabularies")
    return True


# ----------------------------------------------------------------------------- exercise 2: a structured reply

VERDICT_SCHEMA = {"type": "object",
                  "properties": {"answer": {"enum": ["yes", "no"]},
                                 "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
                  "required": ["answer", "confidence"]}
CHECKER_REQUESTS = [("Is Paris the capital of France?", VERDICT_SCHEMA)]
MODEL_NAME = "SmolLM2-135M-Instruct"


def check_structured_reply(fn: Callable, schema: dict | None = None, question: str | None = None, llm=None) -> bool:
    """fn(client, model, question, schema) -> the parsed JSON object of a reply constrained to `schema`,
    through the engine's server with the OpenAI client. Two requests of the checker's, then yours
    (`schema`, `question`) when given; each result must be a dict that validates (schema_problems).
    llm: the engine.LLM to serve (default: the default model on the CPU)."""
    title = "structured reply"
    requests = list(CHECKER_REQUESTS)
    if schema is not None:
        from engine.structured.regex_dfa import StructuredError
        from engine.structured.token_mask import constraint_regex
        try:
            constraint_regex("json_schema", schema)
        except StructuredError as e:
            print(f"[x] {title}: the engine refuses your schema: {e}")
            return False
        requests.append((question or "Answer in JSON.", schema))
    import openai

    import engine
    from engine.serve.server import ServerThread
    own = llm is None
    if own:
        llm = engine.LLM(engine.ensure_default_model(), backend="numpy", max_seqs=2, max_context=512)
    name = getattr(fn, "__name__", "fn")
    try:
        with ServerThread(llm, MODEL_NAME) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0, timeout=300)
            for i, (q, s) in enumerate(requests):
                whose = "your schema" if i == len(CHECKER_REQUESTS) else "the checker's schema"
                try:
                    got = fn(client, MODEL_NAME, q, s)
                except NotImplementedError:
                    print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
                    return False
                except json.JSONDecodeError as e:
                    print(f"[x] {title}: {name}(client, model, {q!r}, {whose}) raised JSONDecodeError: {e} -- the "
                          "reply is not JSON: was the schema sent (response_format={'type': 'json_schema', "
                          "'json_schema': {'name': ..., 'schema': schema}}), and max_tokens large enough to finish it?")
                    return False
                except Exception as e:  # the learner's bug, shown rather than raised
                    print(f"[x] {title}: {name}(client, model, {q!r}, {whose}) raised {type(e).__name__}: {e}")
                    return False
                if isinstance(got, str):
                    print(f"[x] {title}: {name}(...) on {whose} returned the text {got[:60]!r}: return the parsed "
                          "object (json.loads of the message's content)")
                    return False
                problems = schema_problems(got, s)
                if problems:
                    hint = (" -- it looks like the schema was not sent: json_object mode (response_format="
                            "{'type': 'json_object'}) guarantees an object, not the schema's keys and values, and no "
                            "constraint guarantees nothing; ask for response_format={'type': 'json_schema', "
                            "'json_schema': {'name': ..., 'schema': schema}}" if isinstance(got, dict) else "")
                    print(f"[x] {title}: {name}(...) on {whose} returned {json.dumps(got)[:80]}, which does not "
                          f"validate: {problems[0]}{hint}")
                    return False
                print(f"    {q!r} -> {json.dumps(got, ensure_ascii=False)}")
    finally:
        if own:
            llm.close()
    print(f"[OK] {title}: {len(requests)} replies through the server, each parsed into an object that validates "
          "against the schema it was asked for" + (" (yours included)" if schema is not None else ""))
    return True
