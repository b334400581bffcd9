"""Chapter 18 exercises: unpacking int4 words, dequantizing a group-wise weight, and the int4 GEMV kernel.

`check_unpack_int4(fn)` holds your unpacker (uint32 words [N, K / 8] -> the codes [N, K]) to the
engine's `unpack_ref`: a crafted word whose nibbles are 0..7, then seeded random weights. A wrong answer
is matched against the classic mistake (the first input read from the highest bits) and, failing that,
against "the right codes in the wrong order inside each word".
`check_dequantize(fn)` holds your dequantizer (a QuantizedWeight -> float32 W [N, K]) to `dequantize_ref`
on int4 and int8 weights of several shapes and group sizes, names the classic mistakes (nibbles
reversed, the zero point added instead of subtracted, no zero point, the scale of another group, an
int8 weight read as int4), then runs the default model quantized to int4 with your function making
every projection's dense matrix: its logits must equal the engine's quantized model's.
`check_quant_gemv_kernel(source)` (GPU track) runs your kernels_cu/exercises/quant_gemv.cu through
engine/exercises/cuda_check.py: on a GPU, or on the CPU executor where there is none.

Also the chapter's helpers: `capture_inputs` (what one projection of the model receives, for AWQ's
activation statistics) and `perplexity` (of a text under a model, one causal pass).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.ops.quantization import QuantizedWeight, dequantize_ref, pack_ref, quantize_ref, unpack_ref

SEED = 18
MODEL_GROUP_SIZE = 192      # the largest group both of the default model's K (576 and 1536) take


# ----------------------------------------------------------------------------- the chapter's helpers


def capture_inputs(model, weight, prompts: list[list[int]]) -> np.ndarray:
    """float32 [tokens, K]: the rows x that the projection `weight` (an array of model.weights, compared
    by identity) multiplies, over one causal pass of each prompt (CPU backend)."""
    import engine.model.forward_pass as forward_pass
    seen: list[np.ndarray] = []
    real = forward_pass.linear

    def recording(x, w, out=None):
        if w is weight:
            seen.append(np.array(x, dtype=np.float32))
        return real(x, w, out)
    forward_pass.linear = recording
    try:
        for ids in prompts:
            model.logits(ids)
    finally:
        forward_pass.linear = real
    if not seen:
        raise ValueError("that weight is not one of the model's projections (compared by identity)")
    return np.concatenate(seen)


def perplexity(model, ids) -> float:
    """exp(mean negative log-likelihood) of tokens 1.. of `ids`, each predicted from the ones before it."""
    ids = np.asarray(ids)
    logits = model.logits(ids)[:-1].astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


# ----------------------------------------------------------------------------- the classic mistakes


def reversed_unpack(qweight: np.ndarray, bits: int = 4) -> np.ndarray:
    """The first input read from the highest bits of its word (big end first)."""
    per_word = 32 // bits
    codes = unpack_ref(qweight, bits).reshape(qweight.shape[0], -1, per_word)
    return codes[:, :, ::-1].reshape(qweight.shape[0], -1)


def _codes(qw: QuantizedWeight, unpack=unpack_ref) -> np.ndarray:
    N, K = qw.shape
    return unpack(np.asarray(qw.qweight), qw.bits).astype(np.float32).reshape(N, K // qw.group_size, qw.group_size)


def _parts(qw: QuantizedWeight):
    return (np.asarray(qw.zeros).astype(np.float32)[:, :, None], np.asarray(qw.scales).astype(np.float32)[:, :, None])


def reversed_dequantize(qw: QuantizedWeight) -> np.ndarray:
    """(q - z) * s with the codes of each word read in reverse."""
    z, s = _parts(qw)
    return ((_codes(qw, reversed_unpack) - z) * s).reshape(qw.shape)


def plus_zero_dequantize(qw: QuantizedWeight) -> np.ndarray:
    """(q + z) * s: the zero point added."""
    z, s = _parts(qw)
    return ((_codes(qw) + z) * s).reshape(qw.shape)


def no_zero_dequantize(qw: QuantizedWeight) -> np.ndarray:
    """q * s: the zero point forgotten."""
    _, s = _parts(qw)
    return (_codes(qw) * s).reshape(qw.shape)


def tiled_scales_dequantize(qw: QuantizedWeight) -> np.ndarray:
    """Input k scaled by group k % (K / G) instead of k // G (np.tile where np.repeat belongs)."""
    N, K = qw.shape
    q = unpack_ref(np.asarray(qw.qweight), qw.bits).astype(np.float32)
    groups = K // qw.group_size
    z = np.tile(np.asarray(qw.zeros).astype(np.float32), (1, qw.group_size))
    s = np.tile(np.asarray(qw.scales).astype(np.float32), (1, qw.group_size))
    assert z.shape == (N, K) and groups
    return (q - z) * s


def next_group_dequantize(qw: QuantizedWeight) -> np.ndarray:
    """Input k scaled by group k // G + 1 (the last group's inputs by the first group's)."""
    z, s = _parts(qw)
    return ((_codes(qw) - np.roll(z, -1, axis=1)) * np.roll(s, -1, axis=1)).reshape(qw.shape)


def int4_only_dequantize(qw: QuantizedWeight) -> np.ndarray:
    """Every weight unpacked as int4, whatever qw.bits says (fails on int8: twice the codes)."""
    N, K = qw.shape
    q = unpack_ref(np.asarray(qw.qweight), 4).astype(np.float32).reshape(N, K // qw.group_size, qw.group_size)
    z, s = _parts(qw)
    return ((q - z) * s).reshape(N, K)


MISTAKES: dict[str, str] = {
    "reversed": "the nibbles read in the wrong order: word j holds inputs 8j .. 8j + 7, input 8j + i in bits "
                "4i .. 4i + 3, so the FIRST input is in the LOWEST bits ((word >> 4 * i) & 0xF), not the highest",
    "plus_zero": "the zero point added: w = (q - z) * s; z is the code that stands for 0.0, so it is subtracted",
    "no_zero": "the zero point forgotten: q * s is always >= 0; w = (q - z) * s",
    "wrong_group": "the scale and zero point of another group: input k belongs to group k // G (G = "
                   "qw.group_size consecutive inputs per group), so each group's s and z repeat G times along "
                   "the row (np.repeat(scales, G, axis=1), not np.tile)",
    "int8_as_int4": "the int8 weight read as int4: qw.bits says how many bits a code has (8: four codes per word, "
                    "shifts of 8 i and the mask 0xFF; 4: eight codes, shifts of 4 i and the mask 0xF)",
    "order": "the right codes, in the wrong order inside each word: word j holds inputs 8j .. 8j + 7, input "
             "8j + i in bits 4i .. 4i + 3 (the lowest bits hold the first input)",
}


# ----------------------------------------------------------------------------- the cases


def _weight(rng, N: int, K: int, bits: int, G: int, kind: str = "normal") -> QuantizedWeight:
    """A quantized random weight: normal, all positive (a zero point of 0), or rows of very different
    scales (so that a wrong group's scale shows)."""
    w = rng.standard_normal((N, K)).astype(np.float32)
    if kind == "positive":
        w = np.abs(w) + 0.1
    elif kind == "scaled":
        w *= np.exp(rng.uniform(-3, 3, size=(N, K // G))).repeat(G, axis=1).astype(np.float32)
    return quantize_ref(w, bits, G)


def _dequantize_cases() -> list[tuple[str, QuantizedWeight]]:
    rng = np.random.default_rng(SEED)
    shapes = [(4, 4, 64, 32, "normal"), (4, 3, 256, 64, "scaled"), (4, 5, 96, 32, "positive"),
              (4, 7, 576, 192, "scaled"), (4, 2, 128, 128, "normal"), (4, 6, 1536, 192, "scaled"),
              (8, 4, 64, 16, "normal"), (8, 3, 256, 64, "scaled"), (8, 5, 576, 192, "scaled"), (8, 2, 128, -1, "normal")]
    cases = []
    for bits, N, K, G, kind in shapes:
        qw = _weight(rng, N, K, bits, G, kind)
        cases.append((f"int{bits} [{N}, {K}], group {qw.group_size} ({kind} weights)", qw))
    return cases


def _copy(qw: QuantizedWeight) -> QuantizedWeight:
    """A fresh copy the learner may modify without touching the checker's."""
    return QuantizedWeight(np.array(qw.qweight), np.array(qw.scales), np.array(qw.zeros), qw.bits, qw.group_size,
                           qw.shape)


def _as_array(got, shape: tuple, what: str) -> tuple[np.ndarray | None, str]:
    """(the result as an array, '') or (None, what is wrong with it)."""
    arr = np.asarray(got) if isinstance(got, (np.ndarray, list, tuple)) else None
    if arr is None or arr.shape != shape or not np.issubdtype(arr.dtype, np.number):
        shown = f"an array of shape {arr.shape} and dtype {arr.dtype}" if arr is not None else repr(got)[:60]
        return None, f"returned {shown}: return {what} of shape {shape}"
    return arr, ""


def _first_wrong(got: np.ndarray, want: np.ndarray, close: Callable) -> str:
    bad = np.argwhere(~close(got, want))
    n, k = (int(v) for v in bad[0])
    return f"{len(bad):,} of {want.size:,} values differ, first at [{n}, {k}]: got {got[n, k]:.6g}, expected {want[n, k]:.6g}"


def _close(got, want):
    return np.isclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-6)


def _explained_by_other_groups(got: np.ndarray, qw: QuantizedWeight) -> bool:
    """Every wrong value of a dequantized weight is (q - z) * s with the s and z of some group of its row."""
    N, K = qw.shape
    q = unpack_ref(np.asarray(qw.qweight), qw.bits).astype(np.float64)                   # [N, K]
    z = np.asarray(qw.zeros).astype(np.float64)[:, None, :]                               # [N, 1, groups]
    s = np.asarray(qw.scales).astype(np.float64)[:, None, :]
    candidates = (q[:, :, None] - z) * s                                                 # [N, K, groups]
    wrong: np.ndarray = ~_close(got, dequantize_ref(qw))
    close = np.abs(got.astype(np.float64)[:, :, None] - candidates) <= 1e-6 + 1e-5 * np.abs(candidates)
    fits = np.asarray(close.any(axis=2))
    return bool(wrong.any() and np.all(fits | ~wrong))


def _diagnose_dequantize(got: np.ndarray, qw: QuantizedWeight) -> str | None:
    for mistake, wrong in (("reversed", reversed_dequantize), ("plus_zero", plus_zero_dequantize),
                           ("no_zero", no_zero_dequantize)):
        if _close(got, wrong(qw)).all():
            return mistake
    if qw.shape[1] > qw.group_size and _explained_by_other_groups(got, qw):
        return "wrong_group"
    return None


# ----------------------------------------------------------------------------- exercise 1: unpacking


def check_unpack_int4(fn: Callable) -> bool:
    """fn(qweight uint32 [N, K / 8]) -> the codes [N, K] (integers 0..15): input 8j + i of a row from bits
    4i .. 4i + 3 of its word j, equal to the engine's unpack_ref."""
    title = "unpack int4"
    name = getattr(fn, "__name__", "fn")
    rng = np.random.default_rng(SEED)
    crafted = np.array([[0x76543210, 0xFEDCBA98]], dtype=np.uint32)
    cases = [("the words 0x76543210 0xFEDCBA98 (their codes are 0, 1, ..., 15 in input order)", crafted)]
    for N, K in ((3, 8), (5, 64), (7, 576), (4, 1536)):
        cases.append((f"a random int4 weight [{N}, {K}]", pack_ref(rng.integers(0, 16, size=(N, K), dtype=np.uint8), 4)))
    for where, qweight in cases:
        want = unpack_ref(qweight, 4)
        try:
            got = fn(qweight.copy())
        except NotImplementedError:
            print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
            return False
        except Exception as e:  # the learner's bug, shown rather than raised
            print(f"[x] {title}: {name}(qweight) on {where} raised {type(e).__name__}: {e}")
            return False
        arr, problem = _as_array(got, want.shape, "an integer array (one code per input)")
        if arr is None:
            print(f"[x] {title}: {name}(qweight) on {where} {problem}")
            return False
        if np.array_equal(arr, want):
            continue
        line = f"[x] {title}: on {where}: " + _first_wrong(arr.astype(np.float64), want.astype(np.float64), np.equal)
        if np.array_equal(arr, reversed_unpack(qweight)):
            line += f" -- it looks like {MISTAKES['reversed']}"
        elif np.array_equal(np.sort(arr.reshape(len(arr), -1, 8), axis=2), np.sort(want.reshape(len(arr), -1, 8), axis=2)):
            line += f" -- it looks like {MISTAKES['order']}"
        print(line)
        return False
    print(f"[OK] {title}: your codes equal the engine's unpack_ref on {len(cases)} weights (a crafted pair of words, "
          "random ones up to [4, 1536])")
    return True


# ----------------------------------------------------------------------------- exercise 2: dequantizing


def check_dequantize(fn: Callable, in_model: bool = True) -> bool:
    """fn(qw: QuantizedWeight) -> float32 W [N, K] = (q - z) * s, group by group, equal to the engine's
    dequantize_ref on int4 and int8 weights; then (in_model) the default model quantized to int4 with
    your function dequantizing every projection: its logits must equal the engine's quantized model's."""
    title = "dequantize"
    name = getattr(fn, "__name__", "fn")
    cases = _dequantize_cases()
    int4_passed = False
    for where, qw in cases:
        want = dequantize_ref(qw)
        try:
            got = fn(_copy(qw))
        except NotImplementedError:
            print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
            return False
        except Exception as e:  # the learner's bug, shown rather than raised
            line = f"[x] {title}: {name}(qw) on {where} raised {type(e).__name__}: {e}"
            if qw.bits == 8 and int4_passed:
                line += f" -- it looks like {MISTAKES['int8_as_int4']}"
            print(line)
            return False
        arr, problem = _as_array(got, want.shape, "a float array")
        if arr is None:
            hint = f" -- it looks like {MISTAKES['int8_as_int4']}" if qw.bits == 8 and int4_passed else ""
            print(f"[x] {title}: {name}(qw) on {where} {problem}{hint}")
            return False
        if _close(arr, want).all():
            int4_passed = int4_passed or qw.bits == 4
            continue
        line = f"[x] {title}: on {where}: " + _first_wrong(arr, want, _close)
        mistake = _diagnose_dequantize(arr, qw)
        if mistake is None and qw.bits == 8 and int4_passed:
            mistake = "int8_as_int4"
        if mistake:
            line += f" -- it looks like {MISTAKES[mistake]}"
        print(line)
        return False
    n4 = sum(qw.bits == 4 for _, qw in cases)
    if not in_model:
        print(f"[OK] {title}: equal to the engine's dequantize_ref on {n4} int4 and {len(cases) - n4} int8 weights")
        return True
    return _check_in_model(title, fn, n4, len(cases) - n4)


IN_MODEL_PROMPT = "Quantization stores each weight in four bits: a scale, a zero point and a code."


def _check_in_model(title: str, fn: Callable, n4: int, n8: int) -> bool:
    """The default model quantized to int4 (group MODEL_GROUP_SIZE) on the CPU: the engine's logits, then
    the same model with every projection's dense matrix made by fn."""
    import engine
    model_dir = engine.ensure_default_model()
    model = engine.load_model(model_dir, backend="numpy", max_context=128, quantization="int4",
                              group_size=MODEL_GROUP_SIZE)
    ids = engine.load_tokenizer(model_dir).encode(IN_MODEL_PROMPT)
    want = model.logits(ids)                                  # dense matrices by dequantize_ref
    projections = [w for lw in model.weights.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    for qw in projections:
        try:
            got = fn(_copy(qw))
        except Exception as e:  # the learner's bug, shown rather than raised
            print(f"[x] {title}: in the model, on a projection of shape {qw.shape}, your function raised "
                  f"{type(e).__name__}: {e}")
            return False
        if np.shape(got) != qw.shape:
            print(f"[x] {title}: in the model, a projection of shape {qw.shape} came back as {np.shape(got)}")
            return False
        qw.dense = np.asarray(got, dtype=np.float32)
    logits = model.logits(ids)
    diff = float(np.max(np.abs(logits - want)))
    same_tokens = bool(np.array_equal(logits.argmax(axis=1), want.argmax(axis=1)))
    if diff > 1e-3 * max(1.0, float(np.max(np.abs(want)))) or not same_tokens:
        print(f"[x] {title}: on {n4 + n8} weights your function equals the reference, but in the model its logits "
              f"differ from the engine's quantized model's by up to {diff:.3g}"
              + ("" if same_tokens else " and change the predicted tokens"))
        return False
    print(f"[OK] {title}: equal to the engine's dequantize_ref on {n4} int4 and {n8} int8 weights; inside the default "
          f"model quantized to int4 (group {MODEL_GROUP_SIZE}, all {len(projections)} projections dequantized by your "
          f"function) the logits of {len(ids)} tokens equal the engine's (largest difference {diff:.1g})")
    return True


# ----------------------------------------------------------------------------- GPU track: the int4 GEMV


GEMV_WARPS = 8        # the engine's launch: one warp per output row, QGEMV_WARPS rows per block


def _gemv_want(x: np.ndarray, qw: QuantizedWeight, K: int, dequantize=dequantize_ref) -> np.ndarray:
    return (x[:, :K].astype(np.float64) @ dequantize(qw).astype(np.float64).T).astype(np.float32)


def _word_index_group(qw: QuantizedWeight) -> np.ndarray:
    """The kernel's group taken as (word index) // G instead of (input index) // G."""
    N, K = qw.shape
    q = unpack_ref(np.asarray(qw.qweight), 4).astype(np.float32)
    g = (np.arange(K) // 8) // qw.group_size                              # word j = k // 8
    z = np.asarray(qw.zeros).astype(np.float32)[:, g]
    s = np.asarray(qw.scales).astype(np.float32)[:, g]
    return (q - z) * s


def _quant_gemv_case(rng, T: int, N: int, K: int, G: int, pad: int = 0, warps: int = GEMV_WARPS, kind: str = "scaled"):
    from engine.backend import bf16_to_f32
    from engine.exercises.cuda_check import Case, bf16_values, within
    qw = _weight(rng, N, K, 4, G, kind)
    ldx = K + pad
    x_bits, _ = bf16_values(rng, (T, ldx))
    x = bf16_to_f32(x_bits)
    want = _gemv_want(x, qw, K)
    hints = [(MISTAKES["reversed"], _gemv_want(x, qw, K, reversed_dequantize)),
             (MISTAKES["plus_zero"], _gemv_want(x, qw, K, plus_zero_dequantize)),
             (MISTAKES["no_zero"], _gemv_want(x, qw, K, no_zero_dequantize)),
             ("the group of a word taken as (word index) / G: the group of input k is k / G, and word j "
              "holds inputs 8j .. 8j + 7", _gemv_want(x, qw, K, _word_index_group))]
    if K > G:
        hints.append((MISTAKES["wrong_group"], _gemv_want(x, qw, K, next_group_dequantize)))
    if pad:
        strided = x.reshape(-1)[: T * K].reshape(T, K)                   # rows read K apart, not ldx
        hints.append(("x's rows read K values apart: row t of x starts at x + t * ldx (ldx >= K)",
                      _gemv_want(strided, qw, K)))
    hints = [(text, wrong) for text, wrong in hints if not within(wrong, want, False).all()]   # z = 0: no zero hints
    scales_bits = np.asarray(qw.scales).view(np.uint16)
    label = f"T={T} N={N} K={K} G={G}" + (f" ldx={ldx}" if pad else "") + f", {warps} warps per block"
    return Case(label, (-(-N // warps),), 32 * warps,
                {"x": x_bits, "qweight": np.asarray(qw.qweight), "scales": scales_bits, "zeros": np.asarray(qw.zeros)},
                lambda d: (d["x"], np.int64(ldx), d["qweight"], d["scales"], d["zeros"], d["out"], np.int64(N),
                           np.int32(T), np.int32(N), np.int32(K), np.int32(G)),
                "f32", want, hints, nbytes=int(qw.qweight.nbytes + qw.scales.nbytes + qw.zeros.nbytes + T * ldx * 2 + T * N * 4))


def _quant_gemv_cases():
    rng = np.random.default_rng(SEED + 1)
    return [_quant_gemv_case(rng, *c) for c in
            ((1, 5, 64, 32, 0, 1), (3, 19, 96, 32, 8, 8), (8, 12, 256, 64, 0, 8), (2, 9, 576, 192, 0, 4),
             (1, 33, 128, 128, 0, 8, "positive"), (5, 7, 192, 64, 16, 2))]


def check_quant_gemv_kernel(source=None) -> bool | None:
    """GPU track: your int4 GEMV (default: kernels_cu/exercises/quant_gemv.cu; or a path, or the CUDA source
    text), launched as the engine launches quant_gemv_int4 (one warp per output row, 8 warps per block),
    against x @ dequantize_ref(qw)^T, with the likely mistake named; on a GPU, its GB/s beside the engine's,
    then the default model quantized to int4 runs with your kernel in every projection (`run_in_model`)."""
    from engine.exercises.cuda_check import Exercise, check_kernel, cupy_unavailable_reason, read_source
    timing = lambda: _quant_gemv_case(np.random.default_rng(SEED + 2), 1, 4096, 4096, 128)  # noqa: E731
    exercise = Exercise("quant_gemv kernel", "quant_gemv.cu", "quant_gemv_int4", "quant_gemv", _quant_gemv_cases, timing)
    verdict = check_kernel(exercise, source)
    if verdict is not True or cupy_unavailable_reason() is not None:
        return verdict
    return run_in_model(read_source(source, exercise)[0])


def run_in_model(kernel_source: str, new_tokens: int = 16) -> bool:
    """GPU: the default model quantized to int4 (group MODEL_GROUP_SIZE) decodes IN_MODEL_PROMPT greedily
    with the engine's kernels, then with your quant_gemv_int4 plugged into every projection's decode rows
    (engine/plugins.py stage "quant_gemv"): the logits agree to bf16 rounding and the tokens match."""
    import engine
    model_dir = engine.ensure_default_model()
    llm = engine.LLM(model_dir, backend="cupy", max_context=256, quantization="int4", group_size=MODEL_GROUP_SIZE)
    params = engine.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    want = llm.generate([IN_MODEL_PROMPT], params)[0].token_ids
    with engine.use_stage("quant_gemv", cuda_source=kernel_source, kernel="quant_gemv_int4"):
        got = llm.generate([IN_MODEL_PROMPT], params)[0].token_ids
    same = sum(a == b for a, b in zip(got, want))
    if same < len(want) - 2:      # bf16 kernels that sum in another order may flip a near-tie late
        print(f"[x] quant_gemv kernel: in the model your kernel's greedy tokens match the engine's for {same} of "
              f"{len(want)} steps")
        return False
    print(f"[OK] quant_gemv kernel: the default model quantized to int4 decoded {len(want)} tokens with your kernel "
          f"in every projection: {same} of {len(want)} equal to the engine's own")
    return True
