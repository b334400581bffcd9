"""Convert a Llama-architecture GGUF file into an ordinary Hugging Face model directory.

GGUF is llama.cpp's single-file format: a header of typed key/value metadata (architecture, shapes,
the whole tokenizer, the chat template) followed by tensors, many of them block-quantized. This
module turns one back into what the rest of the engine reads:

    config.json              LlamaForCausalLM, from the `llama.*` metadata
    model.safetensors        every tensor dequantized, q/k rows un-permuted, stored as bf16
    tokenizer.json           byte-level BPE rebuilt from the vocab, merges and token types
    tokenizer_config.json    chat template, special tokens
    generation_config.json   bos / eos ids
    gguf_source.json         which file it came from (sha256); written last, see below

The directory is built under `<out>.tmp-<pid>` and renamed into place at the very end, so a
conversion that dies halfway never looks finished. Command line:

    python -m engine.gguf_convert FILE.gguf OUT_DIR

See notes/appendix_default_model.md for the block formats and the q/k permutation, worked by hand.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.formats.config import ConfigError, config_from_dict
from engine.formats.gguf_reader import GGUFFormatError, TensorInfo, read_gguf
from engine.model.weights import expected_shapes  # the one shape rule, shared with the loader
from engine.text.tokenizer import Tokenizer, TokenizerError

CONVERTER_VERSION = 1          # bump when the output changes, so caches get rebuilt
MARKER_FILE = "gguf_source.json"

# GGML tensor type ids we can turn back into floats (names as in ggml.h / gguf.GGMLQuantizationType).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# llama.cpp token types (gguf.TokenType): which ones become added tokens, and which are special.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4
SPECIAL_TOKEN_TYPES = (TOKEN_UNKNOWN, TOKEN_CONTROL)

# `tokenizer.ggml.pre` names a pre-tokenizer by model family; llama.cpp hard-codes what each means.
# Only families we have checked against their original tokenizer.json are listed.
PRE_TOKENIZERS = {
    # SmolLM / SmolLM2: every digit on its own, then GPT-2's byte-level regex split.
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    },
}

LAYER_TENSOR_NAMES = {         # blk.N.<gguf name>.weight -> model.layers.N.<hf name>.weight
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",   # absent when the embeddings are tied
}


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted (unsupported architecture, tensor type, tokenizer, ...)."""


Progress = Callable[..., None]   # progress(message, transient=False)


def print_progress(message: str, transient: bool = False) -> None:
    """Progress on stderr; on a terminal, transient lines (one per tensor) overwrite each other."""
    if sys.stderr.isatty():
        end = "" if transient else "\n"
        sys.stderr.write(f"\r\033[K{message}{end}")
    else:
        sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _quiet(message: str, transient: bool = False) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# Typed access to metadata: every value the converter uses is checked before it is used

MAX_DIMENSION = 1 << 20        # hidden/intermediate sizes, head counts: far above any real model
MAX_CONTEXT = 1 << 24


def _int_field(metadata: dict, name: str, default=None, minimum: int = 1, maximum: int = MAX_DIMENSION) -> int:
    value = metadata.get(name, default)
    if value is None:
        raise GGUFConversionError(f"GGUF metadata is missing {name!r}")
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise GGUFConversionError(f"GGUF metadata {name!r} = {value!r} must be an integer in [{minimum}, {maximum}]")
    return value


def _float_field(metadata: dict, name: str, default: float, minimum: float, maximum: float) -> float:
    value = metadata.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value <= maximum:
        raise GGUFConversionError(f"GGUF metadata {name!r} = {value!r} must be a number in [{minimum:g}, {maximum:g}]")
    return _shortest_float(value)


def _list_field(metadata: dict, name: str, element_type: type, default=None) -> list:
    value = metadata.get(name, default)
    if value is None:
        raise GGUFConversionError(f"GGUF metadata is missing {name!r}")
    if not isinstance(value, list) or not all(isinstance(v, element_type) and not isinstance(v, bool) for v in value):
        raise GGUFConversionError(f"GGUF metadata {name!r} must be an array of {element_type.__name__}")
    return value


def _shortest_float(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.999999747378752e-06. Write the value it meant."""
    return float(str(np.float32(value)))


# ---------------------------------------------------------------------------------------------
# config.json

def build_config(metadata: dict, vocab_size: int, tied: bool) -> dict:
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFConversionError(
            f"unsupported GGUF architecture {arch!r}: only 'llama' (Llama, SmolLM, ...) is supported")

    def key(name, default=None, minimum=1, maximum=MAX_DIMENSION):
        return _int_field(metadata, f"llama.{name}", default, minimum, maximum)

    if key("expert_count", 0, minimum=0) > 0:
        raise GGUFConversionError("mixture-of-experts Llama GGUFs (llama.expert_count > 0) are not supported")
    hidden, n_heads = key("embedding_length"), key("attention.head_count")
    n_kv_heads = key("attention.head_count_kv", n_heads)
    if hidden % n_heads or n_heads % n_kv_heads:
        raise GGUFConversionError(f"head counts do not fit: embedding_length {hidden}, head_count {n_heads}, "
                                  f"head_count_kv {n_kv_heads} (need hidden % heads == 0 and heads % kv_heads == 0)")
    head_dim = key("attention.key_length", hidden // n_heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise GGUFConversionError("attention.key_length != attention.value_length is not a Llama model")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise GGUFConversionError(
            f"partial rotary embeddings (rope.dimension_count {key('rope.dimension_count')} != head_dim "
            f"{head_dim}) are not supported")
    if head_dim % 2:
        raise GGUFConversionError(f"head_dim {head_dim} is odd: rotary embeddings rotate pairs")

    bos, eos_ids = _token_id(metadata, "bos_token_id", vocab_size), eos_token_ids(metadata, vocab_size)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _float_field(metadata, "llama.attention.layer_norm_rms_epsilon", 1e-5, 1e-12, 1.0),
        "rope_theta": _float_field(metadata, "llama.rope.freq_base", 10000.0, 1.0, 1e12),
        "rope_scaling": build_rope_scaling(metadata),
        "max_position_embeddings": key("context_length", maximum=MAX_CONTEXT),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def build_rope_scaling(metadata: dict) -> dict | None:
    """Only unscaled RoPE is expressible: GGUF does not store Llama 3's scaling parameters, and the
    engine implements no other scaling (a `linear` config would be refused at load)."""
    kind = metadata.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    raise GGUFConversionError(f"unsupported RoPE scaling {kind!r} (supported: none)")


def _token_id(metadata: dict, name: str, vocab_size: int) -> int | None:
    if metadata.get(f"tokenizer.ggml.{name}") is None:
        return None
    return _int_field(metadata, f"tokenizer.ggml.{name}", minimum=0, maximum=vocab_size - 1)


def eos_token_ids(metadata: dict, vocab_size: int) -> list[int]:
    """Every id the GGUF names as an end of generation: eos, end-of-turn, end-of-message."""
    ids = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _token_id(metadata, name, vocab_size)
        if value is not None and value not in ids:
            ids.append(value)
    return ids


# ---------------------------------------------------------------------------------------------
# Tensors

def check_tensor_type(tensor) -> None:
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise GGUFConversionError(
            f"tensor {tensor.name!r} has type {kind}; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")


def dequantize(tensor: TensorInfo) -> np.ndarray:
    """One GGUF tensor -> float32 array in row-major (PyTorch) order.

    GGUF lists dimensions fastest-first (ne0 = row length), so a [out, in] linear weight is
    recorded as (in, out); reversed (`tensor.shape`), it is exactly the Hugging Face layout.
    """
    import gguf

    check_tensor_type(tensor)
    # vectorized over all blocks at once: ~0.7 s for SmolLM2's 49152 x 576 Q8_0 embedding
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(tensor.shape)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k projection rows (convert_hf_to_gguf.py LlamaModel.permute).

    Hugging Face's RoPE rotates the pair (x[i], x[i + head_dim/2]); llama.cpp rotates neighbours
    (x[2i], x[2i+1]). Its converter therefore interleaves the two halves of every head's rows:
        permute:  reshape(n_heads, 2, head_dim/2, ...).swapaxes(1, 2)
    and this function is the inverse:
        reshape(n_heads, head_dim/2, 2, ...).swapaxes(1, 2)
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFConversionError(f"q/k weight with {rows} rows does not split into {n_heads} heads")
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


def hf_tensor_name(name: str) -> str:
    if name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[name]
    parts = name.split(".")       # blk.N.attn_q.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in LAYER_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_TENSOR_NAMES[parts[2]]}.weight"
    if name == "rope_freqs.weight":
        raise GGUFConversionError(
            "this GGUF carries precomputed RoPE frequency factors (rope_freqs.weight, Llama 3.1+ "
            "scaling), which cannot be turned back into a config reliably; use the original "
            "Hugging Face directory instead")
    raise GGUFConversionError(f"unexpected tensor {name!r} for a Llama model")


def convert_tensors(tensors: list[TensorInfo], config: dict, progress: Progress) -> dict[str, np.ndarray]:
    """Dequantize every tensor, rename it, un-permute q/k; check the set and shapes against config first."""
    by_name = {t.name: t for t in tensors}
    for t in tensors:   # refuse before spending time on the big ones
        hf_tensor_name(t.name)
        check_tensor_type(t)
    layers = config["num_hidden_layers"]
    if layers * len(LAYER_TENSOR_NAMES) > len(tensors):   # before listing 9 names per claimed layer
        raise GGUFConversionError(f"llama.block_count is {layers} but the file holds only {len(tensors)} tensors")
    expected = expected_shapes(config)
    renamed = {hf_tensor_name(name): name for name in by_name}
    missing = sorted(set(expected) - set(renamed))
    if missing:
        raise GGUFConversionError(f"GGUF is missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    extra = sorted(set(renamed) - set(expected))
    if extra:
        raise GGUFConversionError(f"GGUF has tensors that do not fit the config: {extra[:5]}")
    for hf_name, shape in expected.items():
        t = by_name[renamed[hf_name]]
        if t.shape != shape:
            raise GGUFConversionError(f"{t.name} has shape {list(t.shape)}, config says {list(shape)}")

    converted: dict[str, np.ndarray] = {}
    for i, hf_name in enumerate(expected, start=1):
        t = by_name[renamed[hf_name]]
        progress(f"dequantize [{i}/{len(expected)}] {t.name} {t.tensor_type.name} {list(t.shape)}", transient=True)
        with np.errstate(over="ignore", invalid="ignore"):   # garbage scales: reported just below
            w = dequantize(t)
        if not np.isfinite(w).all():
            raise GGUFConversionError(f"tensor {t.name} holds NaN or infinite values after dequantization")
        if hf_name.endswith("q_proj.weight"):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            w = unpermute_rows(w, config["num_key_value_heads"])
        converted[hf_name] = w
    progress(f"dequantized {len(converted)} tensors")
    return converted


# ---------------------------------------------------------------------------------------------
# Tokenizer

def build_tokenizer_files(metadata: dict, config: dict) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) contents for a byte-level BPE GGUF vocabulary."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFConversionError(
            f"unsupported GGUF tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFConversionError(
            f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))}); "
            "its splitting rules are hard-coded in llama.cpp and not stored in the file")
    tokens = _list_field(metadata, "tokenizer.ggml.tokens", str)
    types = _list_field(metadata, "tokenizer.ggml.token_type", int, [TOKEN_NORMAL] * len(tokens))
    merges = _list_field(metadata, "tokenizer.ggml.merges", str)
    if len(types) != len(tokens):
        raise GGUFConversionError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    if len(tokens) != config["vocab_size"]:
        raise GGUFConversionError(f"GGUF has {len(tokens)} tokens but token_embd.weight has "
                                  f"{config['vocab_size']} rows")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFConversionError("GGUF vocabulary has duplicate tokens")

    added = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind in SPECIAL_TOKEN_TYPES}
             for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
             if kind in SPECIAL_TOKEN_TYPES or kind == TOKEN_USER_DEFINED]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        # same flags as SmolLM2's original tokenizer.json; they only matter for offsets
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }

    def token(key):
        token_id = _token_id(metadata, key, len(tokens))
        return tokens[token_id] if token_id is not None else None

    tokenizer_config = {
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "GPT2Tokenizer",
    }
    if "tokenizer.chat_template" in metadata:
        if not isinstance(metadata["tokenizer.chat_template"], str):
            raise GGUFConversionError("GGUF metadata 'tokenizer.chat_template' must be a string")
        tokenizer_config["chat_template"] = metadata["tokenizer.chat_template"]
    return tokenizer, tokenizer_config


def build_generation_config(metadata: dict, vocab_size: int) -> dict:
    eos = eos_token_ids(metadata, vocab_size)
    generation = {"bos_token_id": _token_id(metadata, "bos_token_id", vocab_size),
                  "eos_token_id": eos[0] if len(eos) == 1 else eos}
    pad = _token_id(metadata, "padding_token_id", vocab_size)
    if pad is not None:
        generation["pad_token_id"] = pad
    return generation


# ---------------------------------------------------------------------------------------------
# The whole conversion

def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> dict:
    """What the marker remembers of each written file, to notice a truncated or altered cache later."""
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_file(path)}


def check_files(model_dir: Path, marker: dict) -> str | None:
    """None when every file the marker lists is as written, else what is wrong.

    Sizes are always compared; a file whose modification time changed is hashed again (a cache
    copied elsewhere passes, and its marker is updated so the hash runs once)."""
    records = marker.get("files")
    if not isinstance(records, dict) or not records:   # an older converter's marker: upgrade it if sound
        problem = _safetensors_incomplete(Path(model_dir) / "model.safetensors")
        if problem:
            return problem
        records = marker["files"] = {p.name: file_record(p) for p in sorted(Path(model_dir).iterdir())
                                     if p.name != MARKER_FILE and p.is_file()}
        moved = True
    else:
        moved = False
    for name, record in records.items():
        path = Path(model_dir) / name
        try:
            stat = path.stat()
        except OSError:
            return f"{path} is missing"
        if stat.st_size != record.get("bytes"):
            return f"{path} has {stat.st_size:,} bytes, {record.get('bytes')} were written (truncated?)"
        if stat.st_mtime_ns != record.get("mtime_ns"):
            if sha256_file(path) != record.get("sha256"):
                return f"{path} was modified since conversion (checksum differs)"
            record["mtime_ns"], moved = stat.st_mtime_ns, True
    if moved:
        try:
            _write_json(Path(model_dir) / MARKER_FILE, marker)
        except OSError:
            pass   # read-only cache: it is verified by hash each time instead
    return None


def _safetensors_incomplete(path: Path) -> str | None:
    """A safetensors file is complete when its size is header + the end of its last tensor."""
    try:
        with open(path, "rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(header_bytes, 100 << 20)))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        expected = 8 + header_bytes + end
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path} is unreadable or malformed ({type(e).__name__})"
    size = path.stat().st_size
    return None if size == expected else f"{path} has {size:,} bytes, its header says {expected:,} (truncated?)"


def read_marker(model_dir: Path) -> dict | None:
    """The finished-conversion marker of a directory, or None when it has none (not finished)."""
    try:
        return json.loads((Path(model_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path, out_dir, *, progress: Progress | None = None) -> Path:
    """Convert `gguf_path` into a new Hugging Face directory `out_dir` (which must not exist yet)."""
    from engine.formats.safetensors import save_file  # looked up at call time: tests replace it

    progress = progress or _quiet
    start = time.perf_counter()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise GGUFConversionError(f"output directory {out_dir} already exists and is not empty")
    try:
        reader = read_gguf(gguf_path)
    except GGUFFormatError as e:
        raise GGUFConversionError(f"cannot read {gguf_path} as GGUF: {e}") from None
    metadata = reader.metadata
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None or len(embedding.shape) != 2:
        raise GGUFConversionError("GGUF has no two-dimensional token_embd.weight tensor")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = build_config(metadata, vocab_size=embedding.shape[0], tied=tied)
    generation_config = build_generation_config(metadata, config["vocab_size"])
    try:   # never write a directory that the loader would refuse
        config_from_dict(config, generation_config)
    except ConfigError as e:
        raise GGUFConversionError(f"the converted config would not load: {e}") from None
    tokenizer, tokenizer_config = build_tokenizer_files(metadata, config)
    try:   # nor a tokenizer it would refuse
        Tokenizer(tokenizer, tokenizer_config)
    except TokenizerError as e:
        raise GGUFConversionError(f"the converted tokenizer would not load: {e}") from None
    progress(f"converting {gguf_path.name}: {config['num_hidden_layers']} layers, "
             f"vocab {config['vocab_size']}, {len(reader.tensors)} tensors")
    tensors = convert_tensors(reader.tensors, config, progress)

    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        progress(f"writing {out_dir.name}/model.safetensors (bf16)")
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"}, dtype="BF16")
        del tensors
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config)
        _write_json(tmp / "tokenizer.json", tokenizer)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        # last: its presence is what says "this directory is complete"
        _write_json(tmp / MARKER_FILE, {"converter_version": CONVERTER_VERSION,
                                        "source_file": gguf_path.name,
                                        "source_sha256": sha256_file(gguf_path),
                                        "files": {p.name: file_record(p) for p in sorted(tmp.iterdir())}})
        if out_dir.exists():          # an empty directory is replaced
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    except OSError as e:
        raise GGUFConversionError(f"could not write {out_dir}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converted {gguf_path.name} -> {out_dir} in {time.perf_counter() - start:.1f} s")
    return out_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.gguf_convert",
        description="Convert a Llama-architecture GGUF (F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors) into a "
                    "Hugging Face model directory with bf16 model.safetensors.")
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        convert_gguf(args.gguf_file, args.out_dir, progress=print_progress)
    except GGUFConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
