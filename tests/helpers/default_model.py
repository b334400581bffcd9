"""Shared test helpers for the GGUF converter and the default model.

- `default_model_dir`: session fixture, the real SmolLM2-135M-Instruct directory (downloads and
  converts it on first use, then the cache is reused). Other test modules get it through
  tests/conftest.py: `from helpers.default_model import default_model_dir  # noqa: F401`.
- `default_gguf_path`: session fixture, the original GGUF file (only the live transformers tests).
- `write_tiny_llama_gguf`: a small random Llama GGUF with every supported tensor type, for tests
  that need no download.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """Once per test process; parallel workers (pytest -n) take turns on a lock file next to the
    cache, so the first one converts and the others find the finished directory."""
    import engine
    from engine.model.default_model import MODEL_NAME, cache_root
    if os.environ.get("ENGINE_MODEL_DIR"):     # a directory given: nothing to convert
        return engine.ensure_default_model()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{MODEL_NAME}.lock"):
        return engine.ensure_default_model()


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock between processes (released when the holder exits, even killed)."""
    with open(path, "a+b") as f:
        if os.name == "nt":
            import msvcrt
            f.seek(0)
            while True:
                try:
                    msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)   # retries for 10 s, then raises
                    break
                except OSError:
                    continue
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def default_gguf_path(tmp_path_factory) -> Path:
    from engine.model.default_model import download_default_gguf
    return download_default_gguf(tmp_path_factory.mktemp("gguf"), log=lambda *a, **k: None)


# ---------------------------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKENS = ["<tool>"]
# "1 2" exists so that the Digits pre-tokenizer visibly matters: with it, "12" is never formed.
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ is", "1 2", "Ġ Ġ"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TINY = dict(hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, context=128)

# GGUF name -> storage type, per layer; layer 0 keeps q/k in F32 so that the un-permutation can be
# checked exactly against the original Hugging Face rows.
LAYER_TYPES = [
    {"attn_q": Q.F32, "attn_k": Q.F32, "attn_v": Q.F16, "attn_output": Q.BF16,
     "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0},
    {"attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1,
     "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1},
]


def tiny_vocab() -> tuple[list[str], list[int]]:
    alphabet = list(bytes_to_unicode().values())
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = CONTROL_TOKENS + alphabet + merged + USER_DEFINED_TOKENS
    types = ([3] * len(CONTROL_TOKENS) + [1] * (len(alphabet) + len(merged))
             + [4] * len(USER_DEFINED_TOKENS))
    return tokens, types


def bf16_representable(rng, shape, scale) -> np.ndarray:
    """Random float32 values that survive a bf16 round trip exactly (low 16 bits zero)."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim: HF row order -> llama.cpp row order."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


@dataclass
class TinyGGUF:
    path: Path
    hf_weights: dict[str, np.ndarray]                  # HF names, HF layout, before quantization
    stored: dict[str, tuple[Q, np.ndarray]] = field(default_factory=dict)   # GGUF name -> raw bytes


def write_tiny_llama_gguf(path, *, arch="llama", tied=True, tokenizer_model="gpt2", pre="smollm",
                          layer_types=LAYER_TYPES, extra_metadata=None, seed=0) -> TinyGGUF:
    path = Path(path)
    h, f, n_layers = TINY["hidden"], TINY["ffn"], TINY["layers"]
    heads, kv_heads = TINY["heads"], TINY["kv_heads"]
    head_dim = h // heads
    tokens, types = tiny_vocab()
    rng = np.random.default_rng(seed)

    writer = gguf.GGUFWriter(path, arch)
    metadata = {
        f"{arch}.context_length": TINY["context"], f"{arch}.embedding_length": h,
        f"{arch}.feed_forward_length": f, f"{arch}.block_count": n_layers,
        f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.dimension_count": head_dim, f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.vocab_size": len(tokens),
        "tokenizer.ggml.model": tokenizer_model, "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    metadata.update(extra_metadata or {})
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)

    result = TinyGGUF(path, {})

    def add(gguf_name, hf_name, w, qtype, permute_heads=None):
        result.hf_weights[hf_name] = w
        stored = llama_cpp_permute(w, permute_heads) if permute_heads else w
        if qtype == Q.F32:
            raw = stored
        elif qtype == Q.F16:
            raw = stored.astype(np.float16)
        else:
            raw = gguf.quants.quantize(stored, qtype)
        result.stored[gguf_name] = (qtype, raw)
        writer.add_tensor(gguf_name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)

    add("token_embd.weight", "model.embed_tokens.weight", bf16_representable(rng, (len(tokens), h), 0.5), Q.Q8_0)
    for layer, kinds in enumerate(layer_types):
        def w(shape, scale=0.1):
            return bf16_representable(rng, shape, scale)
        prefix, hf = f"blk.{layer}", f"model.layers.{layer}"
        add(f"{prefix}.attn_norm.weight", f"{hf}.input_layernorm.weight", 1 + w((h,)), Q.F32)
        add(f"{prefix}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", w((h, h)), kinds["attn_q"], heads)
        add(f"{prefix}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", w((kv_heads * head_dim, h)),
            kinds["attn_k"], kv_heads)
        add(f"{prefix}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", w((kv_heads * head_dim, h)), kinds["attn_v"])
        add(f"{prefix}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", w((h, h)), kinds["attn_output"])
        add(f"{prefix}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", 1 + w((h,)), Q.F32)
        add(f"{prefix}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", w((f, h)), kinds["ffn_gate"])
        add(f"{prefix}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", w((f, h)), kinds["ffn_up"])
        add(f"{prefix}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", w((h, f)), kinds["ffn_down"])
    add("output_norm.weight", "model.norm.weight", 1 + bf16_representable(rng, (h,), 0.1), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", bf16_representable(rng, (len(tokens), h), 0.5), Q.F16)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return result
