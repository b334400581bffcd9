"""JSON Schema -> one regular expression over the JSON text, for constrained decoding.

A schema describes a set of JSON values; the constraint needs the set of *texts* that spell them.
So each part of the schema becomes a regex for its text, and the parts are concatenated:

    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name"]}
    ->  \\{WS"name"WS:WS STRING (?:WS,WS"age"WS:WS INTEGER)? WS\\}

The regex is built as a tree (regex_dfa's nodes), not as text: nothing is parsed twice, a $ref used
in many places is one shared subtree, and object members use `Subsequence`, which the NFA builds in
linear size (as text, optional members spell out quadratically: `schema_to_regex` shows it).

The result is always a *subset* of the texts that are valid: every output it allows is valid JSON that
the schema accepts, while some valid spellings are left out on purpose:
- properties come in the order the schema lists them (a model writes them in that order anyway),
  and no others (`additionalProperties` is treated as false when `properties` is given);
- whitespace between tokens is WHITESPACE: nothing, one space, or a newline and up to 16 spaces.
  That covers compact JSON, json.dumps' ", " and ": ", and pretty-printing with indent 2 to depth 8
  (or 4 to depth 4), and stays bounded: unbounded whitespace is how a constrained model loops
  forever emitting spaces. No whitespace before or after the whole value;
- enum/const values are spelled the way json.dumps(ensure_ascii=False) spells them;
- "any JSON value" (a schema {} or true, `items` missing, an object without `properties`) nests at
  most ANY_VALUE_DEPTH = 3 levels of containers, and json_object mode (`json_object_regex`) is an
  object of such values: at most JSON_OBJECT_DEPTH = 4 levels in all. A regex cannot count brackets
  without a bound, and each level roughly doubles the automaton.

Supported: type (one or a list) string / integer / number / boolean / null / object / array;
properties, required, additionalProperties (false, or a schema when there are no properties: a map);
items, minItems, maxItems, uniqueItems: false; minLength, maxLength, pattern (a search, as JSON
Schema says: unanchored ends match anything), format date / time / date-time / uuid; integer
minimum, maximum, exclusiveMinimum, exclusiveMaximum; enum and const of any JSON values; anyOf,
oneOf (as anyOf: exact when the branches cannot both match one text, e.g. different types or
different required keys), allOf of one schema; $ref to "#/..." pointers ($defs, definitions),
never recursive. Annotations (title, description, examples, default, ...) are ignored. Anything
else that could change which values are valid is refused with a StructuredError naming it.
"""
from __future__ import annotations

import functools
import json
import math

from engine.structured.regex_dfa import (
    MAX_REPEAT,
    Alt,
    Chars,
    Concat,
    Node,
    Repeat,
    StructuredError,
    Subsequence,
    anchors,
    literal,
    parse,
    to_regex,
)

__all__ = ["schema_to_tree", "schema_to_regex", "json_object_tree", "json_object_regex", "json_value_tree",
           "int_range_regex", "WHITESPACE", "ANY_VALUE_DEPTH", "JSON_OBJECT_DEPTH"]

WHITESPACE = r"(?: |\n {0,16})?"
ANY_VALUE_DEPTH = 3
JSON_OBJECT_DEPTH = ANY_VALUE_DEPTH + 1
MAX_SCHEMA_DEPTH = 64                  # nested schema objects (the converter recurses on them)

STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'     # one character of a JSON string
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"

_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"                 # 0001-9999
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {"date": _DATE, "time": _TIME, "date-time": f"{_DATE}[Tt]{_TIME}",
           "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"}

ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$schema", "$id", "$comment", "$anchor",
                         "deprecated", "readOnly", "writeOnly", "$defs", "definitions"})
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")

# The instance types each keyword constrains (it says nothing about values of other types), and the
# ones this module honours per type. A keyword that applies to a type the schema allows but is not
# honoured for it is refused.
APPLIES = {
    **dict.fromkeys(("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                     "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas",
                     "unevaluatedProperties"), {"object"}),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
                     "minContains", "maxContains", "unevaluatedItems"), {"array"}),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format", "contentEncoding", "contentMediaType"), {"string"}),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), {"integer", "number"}),
}
SUPPORTED = {
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems", "uniqueItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": set(), "boolean": set(), "null": set(),
}


# ---- building trees ------------------------------------------------------------------------------
# Fragments of trusted regex text (whitespace, a string, a number) are parsed once and shared;
# structure is assembled as tree nodes, so nothing is re-parsed and objects can use Subsequence.
@functools.lru_cache(maxsize=1024)
def _p(text: str) -> Node:
    return parse(text, max_chars=1 << 20)


def _seq(*parts: str | Node) -> Node:
    items = tuple(_p(part) if isinstance(part, str) else part for part in parts)
    return items[0] if len(items) == 1 else Concat(items)


def _alt(options) -> Node:
    options = list(options)
    return options[0] if len(options) == 1 else Alt(tuple(options))


def _optional(node: Node) -> Node:
    return Repeat(node, 0, 1)


# ---- any JSON value ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def json_value_tree(depth: int = ANY_VALUE_DEPTH, whitespace: str = WHITESPACE) -> Node:
    """Any JSON value with at most `depth` levels of nested containers (0: scalars only)."""
    scalars = _p(f"{STRING}|{NUMBER}|true|false|null")
    if depth <= 0:
        return scalars
    inner = json_value_tree(depth - 1, whitespace)
    return Alt((scalars, _map(inner, whitespace), _array(inner, 0, None, whitespace)))


@functools.lru_cache(maxsize=32)
def json_object_tree(depth: int = JSON_OBJECT_DEPTH, whitespace: str = WHITESPACE) -> Node:
    """json_object mode: any JSON object, containers nested at most `depth` levels (the object itself counts)."""
    return _map(json_value_tree(depth - 1, whitespace), whitespace)


def json_object_regex(depth: int = JSON_OBJECT_DEPTH, whitespace: str = WHITESPACE) -> str:
    return to_regex(json_object_tree(depth, whitespace))


def _map(value: Node, ws: str) -> Node:
    """An object with any string keys, each value matching `value`."""
    member = _seq(STRING, ws, ":", ws, value)
    return _seq(r"\{", ws, _optional(_seq(member, Repeat(_seq(ws, ",", ws, member), 0, None), ws)), r"\}")


def _array(item: Node, lo: int, hi: int | None, ws: str) -> Node:
    """An array of lo..hi items (hi None: unbounded), each matching `item`."""
    if hi == 0:
        return _seq(r"\[", ws, r"\]")
    body = _seq(item, Repeat(_seq(ws, ",", ws, item), max(lo - 1, 0), None if hi is None else hi - 1), ws)
    return _seq(r"\[", ws, body if lo > 0 else _optional(body), r"\]")


# ---- integer ranges ------------------------------------------------------------------------------
def int_range_regex(lo: int | None, hi: int | None) -> str:
    """The decimal spellings (no leading zeros, no "-0") of the integers in [lo, hi]; None: unbounded."""
    if lo is not None and hi is not None and lo > hi:
        raise StructuredError(f"no integer lies in [{lo}, {hi}]")
    options = []
    if lo is None or lo < 0:                          # the negatives, as "-" and a magnitude range
        magnitude_lo = 1 if hi is None or hi >= 0 else -hi
        options.append("-" + _magnitudes(magnitude_lo, None if lo is None else -lo))
    if hi is None or hi >= 0:
        options.append(_magnitudes(0 if lo is None else max(lo, 0), hi))
    return _alt_text(options)


def _magnitudes(lo: int, hi: int | None) -> str:
    """Non-negative integers in [lo, hi] (hi None: unbounded), split by their number of digits."""
    options = []
    lo_digits = len(str(lo))
    top = hi if hi is not None else 10 ** lo_digits - 1
    for digits in range(lo_digits, len(str(top)) + 1):
        a, b = max(lo, 10 ** (digits - 1) if digits > 1 else 0), min(top, 10 ** digits - 1)
        if a <= b:
            options.append(_same_length(str(a), str(b)))
    if hi is None:                                    # and every longer number
        options.append(f"[1-9][0-9]{{{lo_digits},}}")
    if any(len(o) > 50_000 for o in options) or lo_digits > MAX_REPEAT:
        raise StructuredError("integer bounds with too many digits")
    return _alt_text(options)


def _same_length(a: str, b: str) -> str:
    """Digit strings of one length between a and b: the classic split into prefix + [x-y] + [0-9]{k}."""
    if a == b:
        return a
    if len(a) == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return a[0] + _group(_same_length(a[1:], b[1:]))
    k = len(a) - 1
    options = []
    first, last = int(a[0]), int(b[0])
    if a[1:] != "0" * k:                              # a's leading digit, the rest from a[1:] up
        options.append(a[0] + _group(_same_length(a[1:], "9" * k)))
        first += 1
    if b[1:] != "9" * k:
        last -= 1
    if first <= last:                                 # full spans of the digits between
        options.append(f"[{first}-{last}][0-9]{{{k}}}" if first < last else f"{first}[0-9]{{{k}}}")
    if b[1:] != "9" * k:                              # b's leading digit, the rest up to b[1:]
        options.append(b[0] + _group(_same_length("0" * k, b[1:])))
    return _alt_text(options)


def _alt_text(options: list[str]) -> str:
    return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"


def _group(regex: str) -> str:
    return regex if regex.startswith("(?:") or "|" not in regex else f"(?:{regex})"


# ---- strings -------------------------------------------------------------------------------------
_SHORT_ESCAPES = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r"}


def _json_spelled(node: Node) -> Node:
    """A pattern over a string's characters -> the same over its JSON spelling: '"' becomes \\", a
    backslash \\\\, control characters their escapes (\\n, or \\u00XX in either case); the rest raw."""
    if isinstance(node, Chars):
        raw: list[tuple[int, int]] = []
        spelled: list[Node] = []
        for lo, hi in node.ranges:
            for code in range(lo, min(hi, 0x1F) + 1):        # control characters: escaped
                u_form = Concat((literal("\\u00"), *(_either_case(c) for c in f"{code:02x}")))
                short = _SHORT_ESCAPES.get(code)
                spelled.append(Alt((literal(short), u_form)) if short else u_form)
            for special, text in ((0x22, '\\"'), (0x5C, "\\\\")):
                if lo <= special <= hi:
                    spelled.append(literal(text))
            for a, b in ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF)):   # the rest: raw
                if max(lo, a) <= min(hi, b):
                    raw.append((max(lo, a), min(hi, b)))
        options = ([Chars(tuple(raw))] if raw else []) + spelled
        return options[0] if len(options) == 1 else Alt(tuple(options))
    if isinstance(node, Concat):
        return Concat(tuple(_json_spelled(item) for item in node.items))
    if isinstance(node, Alt):
        return Alt(tuple(_json_spelled(option) for option in node.options))
    if isinstance(node, Subsequence):
        return Subsequence(tuple(_json_spelled(item) for item in node.items), node.required, _json_spelled(node.separator))
    return Repeat(_json_spelled(node.node), node.min, node.max)


def _either_case(c: str) -> Chars:
    return Chars(tuple(sorted({(ord(c), ord(c)), (ord(c.upper()), ord(c.upper()))})))


def _pattern_string(pattern: str, where: str) -> Node:
    """JSON Schema `pattern`: a search, so each unanchored end may have any characters around the match."""
    try:
        tree = parse(pattern)
    except StructuredError as e:
        raise StructuredError(f"{where}: pattern: {e}") from None
    at_start, at_end = anchors(pattern)
    any_chars = Repeat(_p(STRING_CHAR), 0, None)
    return _seq('"', *([] if at_start else [any_chars]), _json_spelled(tree), *([] if at_end else [any_chars]), '"')


# ---- the converter -------------------------------------------------------------------------------
def schema_to_tree(schema, whitespace: str = WHITESPACE) -> Node:
    """A JSON schema (a dict, or True for any value) as a regex tree over its instances' JSON text."""
    return _Converter(schema, whitespace).convert(schema, "#", 0)


def schema_to_regex(schema, whitespace: str = WHITESPACE) -> str:
    """The same as regex text (objects with many optional properties spell out quadratically)."""
    return to_regex(schema_to_tree(schema, whitespace))


class _Converter:
    def __init__(self, root, whitespace: str):
        self.root, self.ws = root, whitespace
        self.expanding: list[int] = []       # ids of the $ref targets being expanded (recursion check)
        self.refs: dict[int, Node] = {}      # target id -> its tree (a $ref used twice is converted once)

    def convert(self, schema, where: str, depth: int) -> Node:
        if depth > MAX_SCHEMA_DEPTH:
            raise StructuredError(f"{where}: schema nested deeper than {MAX_SCHEMA_DEPTH}")
        if schema is True:
            return json_value_tree(ANY_VALUE_DEPTH, self.ws)
        if schema is False:
            raise StructuredError(f"{where}: the schema false matches nothing")
        if not isinstance(schema, dict):
            raise StructuredError(f"{where}: a schema must be an object or a boolean, got {type(schema).__name__}")
        keys = set(schema) - ANNOTATIONS
        if "$ref" in keys:
            return self.ref(schema, keys, where, depth + 1)
        for combinator in ("anyOf", "oneOf", "allOf"):
            if combinator in keys:
                return self.combination(schema, keys, combinator, where, depth + 1)
        if "enum" in keys or "const" in keys:
            return self.values(schema, keys, where)
        types = self.types(schema, keys, where)
        return _alt(self.typed(schema, t, where, depth + 1) for t in types)

    def ref(self, schema: dict, keys: set, where: str, depth: int) -> Node:
        if keys != {"$ref"}:
            raise StructuredError(f"{where}: keywords next to $ref are not supported: {sorted(keys - {'$ref'})}")
        ref = schema["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise StructuredError(f"{where}: only local $ref pointers ('#/$defs/Name') are supported, got {ref!r}")
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise StructuredError(f"{where}: $ref {ref!r} points to nothing")
        if id(target) in self.expanding:
            raise StructuredError(f"{where}: recursive $ref {ref!r} (a regex cannot nest without a bound)")
        if id(target) not in self.refs:
            self.expanding.append(id(target))
            try:
                self.refs[id(target)] = self.convert(target, ref, depth)
            finally:
                self.expanding.pop()
        return self.refs[id(target)]

    def combination(self, schema: dict, keys: set, combinator: str, where: str, depth: int) -> Node:
        branches = schema[combinator]
        if keys != {combinator}:
            raise StructuredError(f"{where}: keywords next to {combinator} are not supported: "
                                  f"{sorted(keys - {combinator})}")
        if not isinstance(branches, list) or not branches:
            raise StructuredError(f"{where}: {combinator} must be a non-empty list of schemas")
        if combinator == "allOf":
            if len(branches) != 1:
                raise StructuredError(f"{where}: allOf of more than one schema is not supported")
            return self.convert(branches[0], f"{where}/allOf/0", depth)
        return _alt(self.convert(b, f"{where}/{combinator}/{i}", depth) for i, b in enumerate(branches))

    def values(self, schema: dict, keys: set, where: str) -> Node:
        """enum / const (both: the enum values equal to the const), filtered by `type` if given."""
        others = keys - {"enum", "const", "type"}
        if others:
            raise StructuredError(f"{where}: keywords next to enum/const are not supported: {sorted(others)}")
        if not isinstance(schema.get("enum", []), list):
            raise StructuredError(f"{where}: enum must be a list")
        values = list(schema["enum"]) if "enum" in schema else [schema["const"]]
        if "const" in schema:
            values = [v for v in values if _same_json(v, schema["const"])]
        if "type" in schema:
            types = self.types(schema, {"type"}, where)
            values = [v for v in values if _json_type(v) in types or (_json_type(v) == "integer" and "number" in types)]
        if not values:
            raise StructuredError(f"{where}: enum/const leaves no value")
        return _alt(self.value_literal(v) for v in values)

    def value_literal(self, value) -> Node:
        """One JSON value, spelled as json.dumps(ensure_ascii=False) does, with WHITESPACE between tokens."""
        ws = self.ws
        if isinstance(value, (dict, list)):
            parts = [_seq(literal(json.dumps(k, ensure_ascii=False)), ws, ":", ws, self.value_literal(v))
                     for k, v in value.items()] if isinstance(value, dict) else [self.value_literal(v) for v in value]
            joined: list[str | Node] = []
            for i, part in enumerate(parts):
                joined += [ws, ",", ws, part] if i else [part]
            open_, close = (r"\{", r"\}") if isinstance(value, dict) else (r"\[", r"\]")
            return _seq(open_, ws, *joined, *([ws] if parts else []), close)
        return literal(json.dumps(value, ensure_ascii=False))

    def types(self, schema: dict, keys: set, where: str) -> list[str]:
        """The instance types the schema allows, in TYPES order; inferred from the keywords when `type` is absent."""
        declared = schema.get("type")
        if declared is None:
            inferred = set().union(*(APPLIES[k] for k in keys if k in APPLIES))
            if not inferred:
                unknown = sorted(keys - {"type"})
                if unknown:
                    raise StructuredError(f"{where}: unsupported keyword(s) {unknown}")
                return ["any"]
            declared = [t for t in TYPES if t in inferred]
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not names or any(n not in TYPES for n in names):
            raise StructuredError(f"{where}: type must be one of {list(TYPES)} or a list of them, got {declared!r}")
        for key in sorted(keys - {"type"}):
            if key not in APPLIES:
                raise StructuredError(f"{where}: unsupported keyword {key!r}")
            for t in names:
                if t in APPLIES[key] and key not in SUPPORTED[t]:
                    raise StructuredError(f"{where}: keyword {key!r} is not supported (for type {t!r})")
        return [t for t in TYPES if t in names]

    def typed(self, schema: dict, t: str, where: str, depth: int) -> Node:
        if t == "any":
            return json_value_tree(ANY_VALUE_DEPTH, self.ws)
        if t == "object":
            return self.object(schema, where, depth)
        if t == "array":
            return self.array(schema, where, depth)
        if t == "string":
            return self.string(schema, where)
        if t == "integer":
            return self.integer(schema, where)
        return _p({"number": NUMBER, "boolean": "true|false", "null": "null"}[t])

    def object(self, schema: dict, where: str, depth: int) -> Node:
        ws = self.ws
        properties = schema.get("properties")
        required = schema.get("required", [])
        additional = schema.get("additionalProperties", True)
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise StructuredError(f"{where}: required must be a list of property names")
        if properties is None:
            if required:
                raise StructuredError(f"{where}: required without properties is not supported")
            if additional is False:
                return _seq(r"\{", ws, r"\}")
            value = json_value_tree(ANY_VALUE_DEPTH, ws) if additional is True else \
                self.convert(additional, f"{where}/additionalProperties", depth)
            return _map(value, ws)
        if not isinstance(properties, dict):
            raise StructuredError(f"{where}: properties must be an object")
        missing = [r for r in required if r not in properties]
        if missing:
            raise StructuredError(f"{where}: required properties missing from properties are not supported: {missing}")
        if not properties:
            return _seq(r"\{", ws, r"\}")
        members = tuple(_seq(literal(json.dumps(name, ensure_ascii=False)), ws, ":", ws,
                             self.convert(sub, f"{where}/properties/{name}", depth))
                        for name, sub in properties.items())
        body = _seq(Subsequence(members, tuple(name in required for name in properties), _seq(ws, ",", ws)), ws)
        return _seq(r"\{", ws, body if required else _optional(body), r"\}")

    def array(self, schema: dict, where: str, depth: int) -> Node:
        items = schema.get("items", True)
        if isinstance(items, list):
            raise StructuredError(f"{where}: items as a list (tuple validation) is not supported")
        if schema.get("uniqueItems", False) is not False:
            raise StructuredError(f"{where}: uniqueItems: true is not supported")
        lo, hi = _count(schema, "minItems", where, 0), _count(schema, "maxItems", where, None)
        if hi is not None and lo > hi:
            raise StructuredError(f"{where}: minItems > maxItems")
        for name, n in (("minItems", lo), ("maxItems", hi)):
            if n is not None and n > MAX_REPEAT + 1:
                raise StructuredError(f"{where}: {name} over {MAX_REPEAT + 1} is not supported")
        return _array(self.convert(items, f"{where}/items", depth), lo, hi, self.ws)

    def string(self, schema: dict, where: str) -> Node:
        lo, hi = _count(schema, "minLength", where, 0), _count(schema, "maxLength", where, None)
        fmt, pattern = schema.get("format"), schema.get("pattern")
        if (fmt is not None or pattern is not None) and (lo or hi is not None or (fmt is not None and pattern is not None)):
            raise StructuredError(f"{where}: format/pattern together with each other or with min/maxLength "
                                  "is not supported")
        if fmt is not None:
            if fmt not in FORMATS:
                raise StructuredError(f"{where}: format {fmt!r} is not supported (supported: {sorted(FORMATS)})")
            return _p(f'"{FORMATS[fmt]}"')
        if pattern is not None:
            if not isinstance(pattern, str):
                raise StructuredError(f"{where}: pattern must be a string")
            return _pattern_string(pattern, where)
        if hi is not None and lo > hi:
            raise StructuredError(f"{where}: minLength > maxLength")
        for name, n in (("minLength", lo), ("maxLength", hi)):
            if n is not None and n > MAX_REPEAT:
                raise StructuredError(f"{where}: {name} over {MAX_REPEAT} is not supported")
        if lo == 0 and hi is None:
            return _p(STRING)
        return _seq('"', Repeat(_p(STRING_CHAR), lo, hi), '"')

    def integer(self, schema: dict, where: str) -> Node:
        lo = hi = None
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            bound = schema.get(key)
            if bound is None:
                continue
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
                raise StructuredError(f"{where}: {key} must be a number, got {bound!r}")
            if key == "minimum":
                lo = _tighter(lo, math.ceil(bound), max)
            elif key == "exclusiveMinimum":
                lo = _tighter(lo, math.floor(bound) + 1, max)
            elif key == "maximum":
                hi = _tighter(hi, math.floor(bound), min)
            else:
                hi = _tighter(hi, math.ceil(bound) - 1, min)
        if lo is None and hi is None:
            return _p(INTEGER)
        try:
            return parse(int_range_regex(lo, hi), max_chars=1 << 20)
        except StructuredError as e:
            raise StructuredError(f"{where}: {e}") from None


def _count(schema: dict, key: str, where: str, default):
    n = schema.get(key, default)
    if n is default:
        return n
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise StructuredError(f"{where}: {key} must be a non-negative integer, got {n!r}")
    return n


def _tighter(current, new, pick):
    return new if current is None else pick(current, new)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _same_json(a, b) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b if not isinstance(a, (dict, list)) else json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
