"""Chapters 00-02: the checkers name each classic mistake, accept the right answers, and the learner's
header reader and merge loop run inside the real engine (safetensors.use_header_reader,
tokenizer.use_merge_loop)."""
import math
import struct

import numpy as np
import pytest
from helpers.exercises import accepts, not_attempted, rejects, verdict

from engine.exercises import ch00, ch01, ch02
from engine.formats.safetensors import SafetensorsError, safe_open, save_file, use_header_reader
from engine.text.tokenizer import TokenizerError, load_tokenizer, use_merge_loop


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_PROGRESS_DIR", str(tmp_path / "progress"))


# ----------------------------------------------------------------------------- chapter 00

def test_ch00_checkers_name_the_launch_mistakes(capsys):
    accepts(ch00.check_blocks_for, lambda n, t: (n + t - 1) // t, capsys)
    rejects(ch00.check_blocks_for, lambda n, t: n // t, capsys, "rounds DOWN")
    rejects(ch00.check_blocks_for, lambda n, t: n // t + 1, capsys, "adds a block even when")
    accepts(ch00.check_grid_stride_indices, lambda t, n, total: list(range(t, n, total)), capsys)
    rejects(ch00.check_grid_stride_indices, lambda t, n, total: list(range(t, n + 1, total)), capsys, "i <= n")
    rejects(ch00.check_grid_stride_indices, lambda t, n, total: list(range(t, n)), capsys, "the stride is 1")
    rejects(ch00.check_grid_stride_indices, lambda t, n, total: list(range(0, n, total)), capsys,
            "thread t starts at element t")


def _bf16_right(x):
    bits = ch00.f32_bits(x)
    if math.isnan(x):
        return 0x7FC0
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def test_ch00_checkers_name_the_rounding_mistakes(capsys):
    bits = ch00.f32_bits
    accepts(ch00.check_f32_to_bf16_bits, _bf16_right, capsys)
    rejects(ch00.check_f32_to_bf16_bits, lambda x: 0x7FC0 if math.isnan(x) else bits(x) >> 16, capsys, "truncation")
    rejects(ch00.check_f32_to_bf16_bits, lambda x: 0x7FC0 if math.isnan(x) else (bits(x) + 0x8000) >> 16, capsys,
            "ties go to the even neighbour")
    rejects(ch00.check_f32_to_bf16_bits, lambda x: ((bits(x) + 0x7FFF + ((bits(x) >> 16) & 1)) >> 16) & 0xFFFF,
            capsys, "return 0x7FC0 for every NaN")
    accepts(ch00.check_bf16_spacing, lambda x: math.ldexp(1.0, math.frexp(x)[1] - 8), capsys)
    rejects(ch00.check_bf16_spacing, lambda x: math.ldexp(1.0, math.frexp(x)[1] - 7), capsys, "subtract 1")
    rejects(ch00.check_bf16_spacing, lambda x: x * 2.0**-7, capsys, "not x * 2^-7")
    rejects(ch00.check_bf16_spacing, lambda x: math.ldexp(1.0, math.frexp(x)[1] - 24), capsys, "float32's gap")


# ----------------------------------------------------------------------------- chapter 01: the pieces

def test_ch01_small_checkers_name_the_mistakes(capsys):
    accepts(ch01.check_read_header_length, lambda b: int.from_bytes(b, "little"), capsys)
    rejects(ch01.check_read_header_length, lambda b: int.from_bytes(b, "big"), capsys, "big-endian")
    rejects(ch01.check_read_header_length, lambda b: int.from_bytes(b[:4], "little"), capsys, "first 4 bytes")
    rejects(ch01.check_read_header_length, lambda b: struct.unpack("<q", b)[0], capsys, "signed")
    accepts(ch01.check_tensor_file_range, lambda n, o: (8 + n + o[0], 8 + n + o[1]), capsys)
    rejects(ch01.check_tensor_file_range, lambda n, o: tuple(o), capsys, "taken as positions in the file")
    rejects(ch01.check_tensor_file_range, lambda n, o: (n + o[0], n + o[1]), capsys, "8 bytes of the length")
    accepts(ch01.check_bf16_bits_to_float, ch01._bf16_value, capsys)
    rejects(ch01.check_bf16_bits_to_float, lambda b: ch01._bf16_value(b, subnormal_one=True), capsys, "implicit")
    rejects(ch01.check_bf16_bits_to_float, lambda b: ch01._bf16_value(b, specials=False), capsys, "exponent 255")
    rejects(ch01.check_bf16_bits_to_float, lambda b: abs(ch01._bf16_value(b)) if b == 0x8000 else ch01._bf16_value(b),
            capsys, "-0.0")
    accepts(ch01.check_find_overlap, ch01._first_overlap, capsys)
    rejects(ch01.check_find_overlap, lambda r: ch01._first_overlap_in(list(r.items())), capsys, "sort them")
    rejects(ch01.check_find_overlap,
            lambda r: ch01._first_overlap_in(sorted(r.items(), key=lambda i: i[1]), touching=True), capsys,
            "end is exclusive")


# ----------------------------------------------------------------------------- chapter 01: the whole reader

def test_ch01_reference_reader_passes_and_every_crafted_file_is_judged_like_the_engine(capsys, tmp_path):
    accepts(ch01.check_read_header, ch01.reference_header_reader, capsys)
    for i, case in enumerate(ch01.header_cases()):     # the crafted files mean what the engine says
        path = tmp_path / f"{i}.safetensors"
        path.write_bytes(case.data)
        if case.want is None:
            with pytest.raises(SafetensorsError):
                safe_open(path)
        else:
            with safe_open(path) as f:
                assert {n: (f.dtype(n), f.shape(n), f.data_start + f.info(n).begin, f.data_start + f.info(n).end)
                        for n in f.keys()} == case.want


@pytest.mark.parametrize("text, switches", ch01.HEADER_MISTAKES, ids=[str(s) for _, s in ch01.HEADER_MISTAKES])
def test_ch01_reader_checker_names_each_mistake(text, switches, capsys):
    rejects(ch01.check_read_header, lambda data: ch01.reference_header_reader(data, **switches), capsys,
            f"it looks like {text}")


def _handwritten_reader(data, big_endian=False, file_offsets=False, skip_metadata=True):
    """A reader written the way a learner writes it (not the checker's reference), with one mistake switched on."""
    import json
    n = struct.unpack(">Q" if big_endian else "<Q", data[:8])[0]
    if 8 + n > len(data):
        raise ValueError("header past the end")
    header = json.loads(data[8:8 + n])
    table, position = {}, 0
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__" or not skip_metadata),
                     key=lambda kv: tuple(kv[1]["data_offsets"]))
    for name, e in entries:
        begin, end = e["data_offsets"]
        if begin != position or end < begin or math.prod(e["shape"]) * ch01.ITEMSIZE[e["dtype"]] != end - begin:
            raise ValueError(name)
        position = end
        base = 0 if file_offsets else 8 + n
        table[name] = (e["dtype"], tuple(e["shape"]), base + begin, base + end)
    if position != len(data) - 8 - n:
        raise ValueError("trailing bytes")
    return table


def test_ch01_reader_checker_on_a_handwritten_reader(capsys):
    rejects(ch01.check_read_header, lambda d: _handwritten_reader(d, big_endian=True), capsys, "big-endian")
    rejects(ch01.check_read_header, lambda d: _handwritten_reader(d, file_offsets=True), capsys,
            "taken as positions in the file")
    rejects(ch01.check_read_header, lambda d: _handwritten_reader(d, skip_metadata=False), capsys,
            "__metadata__ was treated as a tensor")
    # a KeyError for the unknown dtype is a refusal, but not the ValueError a caller can catch
    rejects(ch01.check_read_header, _handwritten_reader, capsys, "refused a broken file with KeyError")
    assert ch01.check_read_header(not_attempted) is False
    assert verdict(capsys).startswith("[ ]")


def test_use_header_reader_puts_the_learners_table_in_charge(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int32)}, path)
    with safe_open(path) as f:
        engine_bytes = {n: f.raw(n).copy() for n in f.keys()}
    calls = []

    def reader(data):
        calls.append(len(data))
        return ch01.reference_header_reader(data)

    with use_header_reader(reader):
        with safe_open(path) as f:
            assert {n: f.raw(n).copy().tolist() for n in f.keys()} == {n: v.tolist() for n, v in engine_bytes.items()}
    assert calls == [path.stat().st_size]
    with safe_open(path) as f:              # the block is over: the engine's parser again
        assert f.keys() == ["a", "b"]
    assert calls == [path.stat().st_size]

    def swapped(data):                      # a wrong table that is still safe to read: the learner's own
        table = ch01.reference_header_reader(data)
        return {"a": table["a"][:2] + table["a"][2:], "b": ("F32",) + table["b"][1:]}
    with use_header_reader(swapped), safe_open(path) as f:
        assert f.dtype("b") == "F32"
    for bad, message in [(lambda d: {"a": ("F32", (99,), 0, 396)}, "outside the"),
                         (lambda d: {"a": ("Q4", (2,), 0, 1)}, "unknown dtype"),
                         (lambda d: {"a": ("F32", (3,), 100, 104)}, "but 4 bytes"),
                         (lambda d: ch01.reference_header_reader(d[:10]), "refused the file")]:
        with use_header_reader(bad), pytest.raises(SafetensorsError, match=message):
            safe_open(path)


@pytest.mark.slow
def test_ch01_the_model_loads_through_the_learners_reader(default_model_dir, capsys):
    assert ch01.check_reader_in_model(ch01.reference_header_reader) is True
    line = verdict(capsys)
    assert line.startswith("[OK]") and "272 tensors" in line and "Paris" in line
    rejects(ch01.check_reader_in_model, lambda d: ch01.reference_header_reader(d, base="no8"), capsys,
            "start -8 bytes from the right one")
    assert ch01.check_reader_in_model(not_attempted) is False
    assert verdict(capsys).startswith("[ ]")


# ----------------------------------------------------------------------------- chapter 02

@pytest.fixture(scope="module")
def llama3():
    return ch02.llama3_tokenizer()


def test_ch02_merge_checker_accepts_one_or_every_occurrence(llama3, capsys):
    accepts(ch02.check_merge_loop, ch02.merge_variant, capsys, llama3)
    accepts(ch02.check_merge_loop, lambda s, r: ch02.merge_variant(s, r, every_occurrence=True), capsys, llama3)


@pytest.mark.parametrize("switches, named", [
    ({"pick": "highest"}, "the HIGHEST rank merged first"),
    ({"pick": "first"}, "whatever its rank"),
    ({"ties": "right"}, "LEFTMOST occurrence merges first"),
    ({"max_merges": 3}, "stopped too early"),
    ({"max_merges": 0}, "stopped too early"),
])
def test_ch02_merge_checker_names_each_mistake(llama3, switches, named, capsys):
    rejects(ch02.check_merge_loop, lambda s, r: ch02.merge_variant(s, r, **switches), capsys, named, llama3)


def test_use_merge_loop_runs_the_learners_loop_and_leaves_the_cache_clean(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    text = "The tokenizer merges byte pairs, aaaaaaaaa!"
    right = tok.encode(text)
    seen = []

    def loop(symbols, ranks):
        seen.append("".join(symbols))
        return ch02.merge_variant(symbols, ranks)

    with use_merge_loop(loop):
        assert tok.encode(text) == right
        assert tok.encode(text) == right        # no cache in between: the loop runs again
    assert seen.count("Ġtokenizer") == 2
    with use_merge_loop(lambda s, r: ch02.merge_variant(s, r, pick="highest")):
        assert tok.encode(text) != right
    assert tok.encode(text) == right            # the wrong ids never reached the engine's cache
    with use_merge_loop(lambda s, r: ["".join(s)]), pytest.raises(TokenizerError, match="not a token"):
        tok.encode("antidisestablishmentarianism")
    with use_merge_loop(lambda s, r: "".join(s)), pytest.raises(TokenizerError, match="list of symbols"):
        tok.encode("cat")


@pytest.mark.slow
def test_ch02_merge_loop_inside_the_tokenizer(default_model_dir, capsys):
    assert ch02.check_merge_loop_in_tokenizer(ch02.merge_variant) is True
    line = verdict(capsys)
    assert line.startswith("[OK]") and "ids of tokenizers" in line and "Paris" in line
    rejects(ch02.check_merge_loop_in_tokenizer, lambda s, r: ch02.merge_variant(s, r, pick="highest"), capsys,
            "the HIGHEST rank merged first")
    rejects(ch02.check_merge_loop_in_tokenizer, lambda s, r: ch02.merge_variant(s, r, ties="right"), capsys,
            "LEFTMOST occurrence")
    rejects(ch02.check_merge_loop_in_tokenizer, lambda s, r: ch02.merge_variant(s, r, max_merges=3), capsys,
            "stopped too early")
    assert ch02.check_merge_loop_in_tokenizer(not_attempted) is False
    assert verdict(capsys).startswith("[ ]")
