"""Chapter 18 checkers: unpacking int4 words, dequantizing a group-wise weight (arrays, then inside the
default model quantized to int4) and the int4 GEMV kernel (on a GPU, or through the CPU executor). The
references and worked solutions pass; each classic mistake gets its named verdict; a broken contract
is named; unfinished work is reported as not attempted."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.exercises import accepts, not_attempted, rejects

from engine.exercises import ch18, cuda_check
from engine.ops.quantization import dequantize_ref, unpack_ref


def shift_unpack(qweight):
    """Right, as the chapter's solution writes it: one shift and mask per position of the word."""
    shifts = np.arange(8, dtype=np.uint32) * 4
    return ((qweight[:, :, None] >> shifts) & 0xF).reshape(qweight.shape[0], -1).astype(np.uint8)


def loop_dequantize(qw):
    """Right, another way: group by group, with repeat; both bit widths."""
    N, K = qw.shape
    per_word, mask = 32 // qw.bits, (1 << qw.bits) - 1
    shifts = np.arange(per_word, dtype=np.uint32) * qw.bits
    q = ((qw.qweight[:, :, None] >> shifts) & mask).reshape(N, K).astype(np.float32)
    z = np.repeat(qw.zeros.astype(np.float32), qw.group_size, axis=1)
    s = np.repeat(qw.scales.astype(np.float32), qw.group_size, axis=1)
    return (q - z) * s


def swapped_pairs_unpack(qweight):
    """Each byte's two nibbles swapped (the high nibble first): right codes, wrong order in the word."""
    codes = unpack_ref(qweight, 4).reshape(qweight.shape[0], -1, 2)
    return codes[:, :, ::-1].reshape(qweight.shape[0], -1)


def transposed_unpack(qweight):
    return unpack_ref(qweight, 4).T


def bf16_dequantize(qw):
    """Right values rounded to bf16 on the way out: not equal to the fp32 reference."""
    from engine.backend import bf16_to_f32, f32_to_bf16
    return bf16_to_f32(f32_to_bf16(dequantize_ref(qw)))


def test_the_references_and_the_solutions_pass(capsys):
    accepts(ch18.check_unpack_int4, lambda q: unpack_ref(q, 4), capsys)
    accepts(ch18.check_unpack_int4, shift_unpack, capsys)
    accepts(lambda fn: ch18.check_dequantize(fn, in_model=False), loop_dequantize, capsys)


def test_the_solution_runs_inside_the_model(capsys, default_model_dir):
    assert ch18.check_dequantize(loop_dequantize) is True
    out = capsys.readouterr().out
    assert out.startswith("[OK]") and "inside the default model quantized to int4" in out, out


@pytest.mark.parametrize("fn, hint", [
    (ch18.reversed_unpack, "the FIRST input is in the LOWEST bits"),
    (swapped_pairs_unpack, "the right codes, in the wrong order inside each word"),
    (transposed_unpack, "return an integer array (one code per input) of shape (1, 16)"),
])
def test_unpack_mistakes_are_named(fn, hint, capsys):
    rejects(ch18.check_unpack_int4, fn, capsys, hint)


@pytest.mark.parametrize("fn, hint", [
    (ch18.reversed_dequantize, "the nibbles read in the wrong order"),
    (ch18.plus_zero_dequantize, "the zero point added"),
    (ch18.no_zero_dequantize, "the zero point forgotten"),
    (ch18.tiled_scales_dequantize, "the scale and zero point of another group"),
    (ch18.next_group_dequantize, "the scale and zero point of another group"),
    (ch18.int4_only_dequantize, "the int8 weight read as int4"),
    (bf16_dequantize, "values differ, first at"),
])
def test_dequantize_mistakes_are_named(fn, hint, capsys):
    rejects(lambda f: ch18.check_dequantize(f, in_model=False), fn, capsys, hint)


def test_a_function_that_breaks_in_the_model_is_named(capsys, default_model_dir):
    calls = []

    def right_then_wrong(qw):
        calls.append(1)
        return dequantize_ref(qw) * (1.0 if len(calls) < 12 else 1.5)
    rejects(ch18.check_dequantize, right_then_wrong, capsys, "in the model its logits differ")


def test_not_attempted(capsys):
    assert ch18.check_unpack_int4(not_attempted) is False
    assert "not attempted yet" in capsys.readouterr().out
    assert ch18.check_dequantize(not_attempted) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_the_helpers(default_model_dir):
    import engine
    model = engine.load_model(default_model_dir, backend="numpy", max_context=64)
    ids = engine.load_tokenizer(default_model_dir).encode("The capital of France is Paris.")
    x = ch18.capture_inputs(model, model.weights.layers[3].gate_up, [ids, ids[:4]])
    assert x.shape == (len(ids) + 4, model.config.hidden_size) and np.isfinite(x).all()
    with pytest.raises(ValueError):
        ch18.capture_inputs(model, np.zeros(3), [ids])
    assert 1.0 < ch18.perplexity(model, ids) < 1000.0


# ---------------------------------------------------------------------------------------- the kernel

def _cpu_executor_or_skip():
    from engine.backend import cupy_unavailable_reason
    if cupy_unavailable_reason() is None:
        return
    from engine.exercises.cuda_cpu import executor as cuda_cpu
    why = cuda_cpu.unavailable_reason()
    if why is not None:
        pytest.skip(f"no GPU and no CPU executor: {why}")


def _solution() -> str:
    return (cuda_check.SOLUTIONS_DIR / "quant_gemv.cu").read_text()


def test_the_kernel_exercise_has_a_skeleton_and_a_solution():
    skeleton = (cuda_check.EXERCISES_DIR / "quant_gemv.cu").read_text()
    assert "TODO" in skeleton and "TODO" not in _solution()
    signature = skeleton[skeleton.index('extern "C"'):skeleton.index("{", skeleton.index('extern "C"'))]
    assert signature in _solution()
    engine_kernel = (cuda_check.KERNELS_DIR / "quant_gemv.cu").read_text()
    assert "quant_gemv_int4(QGEMV_ARGS)" in engine_kernel     # the same extern "C" name as the engine's


def test_the_hints_differ_from_the_answer_and_each_other():
    for case in ch18._quant_gemv_cases():
        texts = [t for t, _ in case.hints]
        assert len(set(texts)) == len(texts)
        for text, wrong in case.hints:
            assert not cuda_check.within(wrong, case.want, False).all(), (case.label, text)


@pytest.mark.slow
def test_the_worked_kernel_passes_and_the_skeleton_is_unwritten(capsys):
    _cpu_executor_or_skip()
    assert ch18.check_quant_gemv_kernel(cuda_check.SOLUTIONS_DIR / "quant_gemv.cu") is True
    assert capsys.readouterr().out.startswith("[OK] quant_gemv kernel: all 6 cases pass")
    assert ch18.check_quant_gemv_kernel() is False
    assert "no output element was written" in capsys.readouterr().out


BROKEN = [
    ("(word >> (4 * i)) & 0xFu", "(word >> (28 - 4 * i)) & 0xFu", "the FIRST input is in the LOWEST bits"),
    ("(float)((word >> (4 * i)) & 0xFu) - z", "(float)((word >> (4 * i)) & 0xFu) + z", "the zero point added"),
    ("(float)((word >> (4 * i)) & 0xFu) - z", "(float)((word >> (4 * i)) & 0xFu)", "the zero point forgotten"),
    ("g = k0 / G;", "g = j / G;", "(word index) / G"),
    ("g = k0 / G;", "g = (k0 / G + 1) % groups;", "the scale and zero point of another group"),
    ("x + t * ldx + k0", "x + t * K + k0", "x's rows read K values apart"),
    ("if (lane == 0) out[t * ldo + n] = v;", "if (lane == 0 && n > 0) out[t * ldo + n] = v;", "unwritten elements"),
]


@pytest.mark.slow
@pytest.mark.parametrize("old, new, hint", BROKEN, ids=[b[2][:28] for b in BROKEN])
def test_a_broken_kernel_gets_the_right_diagnosis(old, new, hint, capsys):
    _cpu_executor_or_skip()
    source = _solution()
    assert old in source, old
    assert ch18.check_quant_gemv_kernel(source.replace(old, new)) is False
    out = capsys.readouterr().out
    assert out.startswith("[x] quant_gemv kernel") and hint in out, out
