"""Produce tests/fixtures/smollm2_reference.json with torch + transformers, the independent reader.

    pip install torch==2.13.0 transformers accelerate
    python tests/make_reference_fixtures.py          # ~1 minute on 2 CPU cores

What it does:
1. `engine.ensure_default_model()` gives our converted bf16 directory; the original GGUF is fetched
   again next to a temporary folder.
2. transformers loads the GGUF itself (its own dequantizer, q/k un-permutation and tokenizer
   conversion) and, separately, our directory. We record how closely they agree: every weight
   (bf16-rounded GGUF weight vs ours), the logits, the tokenizer ids on CORPUS, and the greedy answer
   to "What is the capital of France?".
3. Reference values, computed by transformers in fp32 on our converted directory, for PROMPTS:
   token ids, the top-10 logits at every position, and a greedy continuation of NEW_TOKENS tokens.
   tests/test_default_model.py checks the engine against these without needing torch.

The live tests in tests/test_default_model.py import the functions below and recompute everything.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import regex

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_reference.json"
TOP_K = 10
NEW_TOKENS = 20
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_ANSWER = "The capital of France is Paris."

PROMPTS = [   # a chat prompt is rendered with the model's own chat template
    {"name": "france", "messages": FRANCE},
    {"name": "python", "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}]},
    {"name": "system_colors", "messages": [{"role": "system", "content": "You answer in one short sentence."},
                                           {"role": "user", "content": "Name three primary colors."}]},
    {"name": "two_turns", "messages": [{"role": "user", "content": "Hi! My name is Ada."},
                                       {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
                                       {"role": "user", "content": "What is my name?"}]},
    {"name": "numbers", "text": "In 2024 there were 366 days, 12 months and 52 weeks. Counting: 1, 2, 3,"},
    {"name": "story", "text": "Once upon a time, in a small village by the sea, there lived"},
]

CORPUS = [
    "Hello world", "Hello, world!", " leading space", "trailing space ", "Don't stop; I'll go, we're done.",
    "The quick brown fox jumps over the lazy dog.", "UPPER lower MiXeD CamelCase snake_case",
    "In 2024, about 8,100,000,000 people lived on Earth.", "pi = 3.14159265358979",
    "Call 555-0199 or +1 (800) 123-4567.", "Meet at 12:30 on 2024-11-29.", "x1 y22 z333 v4444",
    "a  1", "x = [1,  2,   3]", "\n\n3 items", "1  2   3    4", "table:\n|  1 |  2 |\n|---|---|",
    "    return 42", "\tindent\t7", "E = mc^2 and 1e-5 and 0x1F",
    "def add(a, b):\n    return a + b\n", '{"key": [1, 2.5, null], "ok": true}',
    "https://example.com/path?q=1&r=two#frag", "naïve café résumé Zürich", "中文分词测试 日本語のテキスト",
    "emoji 🤖🚀 and ❤️", "Arabic digits ٣٤٥ and circled ①②", "   \n\n   \t\n", "line1\r\nline2\r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|>", "a<|im_end|>b", "<repo_name>engine<file_sep>main.py",
    "Ελληνικά, русский, עברית, हिन्दी", "¡Hola! ¿Qué tal? Ça va très bien.",
    "The year 1999 was followed by 2000 and then 2001.",
]


def split_digits(text: str) -> list[str]:
    """The Digits(individual_digits=True) step: every numeric character (\\p{N}) becomes its own piece."""
    return [piece for piece in regex.split(r"(\p{N})", text) if piece]


def render(tokenizer, prompt: dict) -> str:
    if "messages" in prompt:
        return tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
    return prompt["text"]


def load_readers(model_dir: Path, gguf_path: Path):
    """(model from our directory, model from the GGUF, tokenizer from our dir, tokenizer from the GGUF)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from_dir = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32).eval()
    tok_dir = AutoTokenizer.from_pretrained(model_dir)
    tok_gguf = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return from_dir, from_gguf, tok_dir, tok_gguf


def logits_of(model, ids: list[int]) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()   # [T, vocab]


def greedy(model, ids: list[int], eos_ids: list[int]) -> dict:
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    new = out[0, len(ids):].tolist()
    stopped = bool(new) and new[-1] in eos_ids
    return {"token_ids": new, "finish_reason": "stop" if stopped else "length"}


def prompt_reference(model, tokenizer, prompt: dict, eos_ids: list[int]) -> dict:
    """What the engine must reproduce: ids, top-k logits per position, greedy continuation."""
    text = render(tokenizer, prompt)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    logits = logits_of(model, ids)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP_K]              # [T, k]
    values = np.take_along_axis(logits, top, axis=-1)
    continuation = greedy(model, ids, eos_ids)
    return {"name": prompt["name"], "text": text, "token_ids": ids,
            "topk_ids": top.tolist(), "topk_values": np.round(values, 5).tolist(),
            "greedy": {**continuation, "text": tokenizer.decode(continuation["token_ids"])}}


def logits_agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """How far logits b (our bf16 dir) are from logits a (transformers on the GGUF, fp32 weights)."""
    return {"relative_l2": float(np.linalg.norm(a - b) / np.linalg.norm(a)),
            "max_abs_diff": float(np.abs(a - b).max()),
            "max_abs_diff_over_max_abs": float(np.abs(a - b).max() / np.abs(a).max()),
            "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean())}


def bf16_round(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)


def weights_agreement(from_gguf, from_dir) -> dict:
    """Every weight of ours should be exactly bf16(transformers' own dequantized GGUF weight)."""
    ours = from_dir.state_dict()
    tensors = mismatched_elements = 0
    for name, weight in from_gguf.state_dict().items():
        tensors += 1
        mismatched_elements += int((ours[name].numpy() != bf16_round(weight.numpy())).sum())
    return {"tensors": tensors, "elements_differing_from_bf16_of_gguf": mismatched_elements}


def tokenizer_comparison(tok_gguf, tokenizer_json: Path) -> list[dict]:
    """transformers' GGUF tokenizer vs `tokenizers` on our tokenizer.json, on CORPUS.

    gguf_ids: the GGUF tokenizer on the whole text. gguf_ids_digits_split: the same tokenizer on
    each piece of split_digits(text), concatenated -- i.e. with the Digits step put back.
    """
    from tokenizers import Tokenizer
    ours = Tokenizer.from_file(str(tokenizer_json))
    rows = []
    for text in CORPUS:
        def encode(s):
            return tok_gguf(s, add_special_tokens=False)["input_ids"]
        rows.append({"text": text, "gguf_ids": encode(text),
                     "gguf_ids_digits_split": [i for piece in split_digits(text) for i in encode(piece)],
                     "our_ids": ours.encode(text, add_special_tokens=False).ids})
    return rows


def eos_ids_of(model_dir: Path) -> list[int]:
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]


def build_fixture(model_dir: Path, gguf_path: Path) -> dict:
    import torch
    import transformers

    from engine.gguf_convert import CONVERTER_VERSION, read_marker
    torch.manual_seed(0)
    from_dir, from_gguf, tok_dir, tok_gguf = load_readers(model_dir, gguf_path)
    eos_ids = eos_ids_of(model_dir)
    prompts = [prompt_reference(from_dir, tok_dir, p, eos_ids) for p in PROMPTS]
    agreement = {p["name"]: logits_agreement(logits_of(from_gguf, p["token_ids"]),
                                             logits_of(from_dir, p["token_ids"])) for p in prompts}
    france_ids = prompts[0]["token_ids"]
    france_gguf = greedy(from_gguf, france_ids, eos_ids)
    return {
        "about": "reference values for the converted SmolLM2-135M-Instruct; see tests/make_reference_fixtures.py",
        "source_sha256": read_marker(model_dir)["source_sha256"],
        "converter_version": CONVERTER_VERSION,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "top_k": TOP_K,
        "prompts": prompts,
        "gguf_vs_converted": {
            "weights": weights_agreement(from_gguf, from_dir),
            "logits": agreement,
            "france_answer_from_gguf": tok_gguf.decode(france_gguf["token_ids"], skip_special_tokens=True),
            "france_answer_from_converted": tok_dir.decode(prompts[0]["greedy"]["token_ids"],
                                                           skip_special_tokens=True),
        },
        "tokenizer": tokenizer_comparison(tok_gguf, model_dir / "tokenizer.json"),
    }


def main() -> int:
    import engine
    from engine.default_model import download_default_gguf

    model_dir = engine.ensure_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = download_default_gguf(Path(tmp))
        fixture = build_fixture(model_dir, gguf_path)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(fixture, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    summary = {k: fixture["gguf_vs_converted"][k] for k in fixture["gguf_vs_converted"]}
    differing = [row["text"] for row in fixture["tokenizer"] if row["gguf_ids"] != row["our_ids"]]
    print(json.dumps(summary, indent=1, ensure_ascii=False), file=sys.stderr)
    print(f"tokenizer: {len(differing)}/{len(CORPUS)} corpus strings differ: {differing}", file=sys.stderr)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from anywhere
    sys.exit(main())
