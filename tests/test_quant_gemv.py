"""The quantized GEMV and dequantize kernels (kernels_cu/quant_gemv.cu, engine/ops/quant_gemv.py).

Without a GPU: every kernel of the file runs on the CPU executor (engine/exercises/cuda_cpu: the same
source compiled by the host C++ compiler, each launch in a child process with its buffers between
inaccessible pages, so a read past an input faults) on small awkward shapes, against the NumPy
references of engine/ops/quantization.py: quant_linear_ref (fp32 sums in another order: a relative
bound) and f32_to_bf16(dequantize_ref) (bit for bit). The output is poisoned and followed by a
poisoned guard: an unwritten element or a write past the end shows.
On a GPU (`@pytest.mark.gpu`): the Llama-3.2-1B projections, every row count (1..16: the tensor-core
kernel, against mma_weight_ref, the bf16 W it multiplies), unaligned and strided operands (the CUDA-core
kernel), the prefill path (dequantize + cuBLAS), a learner's kernel plugged in, a CUDA-graph capture.
"""

import numpy as np
import pytest

from engine.backend import KERNELS_DIR, bf16_to_f32, f32_to_bf16
from engine.exercises.cuda_check import Case
from engine.exercises.cuda_cpu import executor as cuda_cpu
from engine.ops import quant_gemv as qg
from engine.ops.quantization import QuantizedWeight, dequantize_ref, quant_linear_ref, quantize_ref

SOURCE = KERNELS_DIR / "quant_gemv.cu"
DEFINES = {"QGEMV_MAX_ROWS": qg.QGEMV_MAX_ROWS, "QGEMV_WARPS": qg.QGEMV_WARPS, "QGEMV_UNROLL": qg.QGEMV_UNROLL,
           "QMMA_WARPS": qg.QMMA_WARPS, "QMMA_UNROLL": qg.QMMA_UNROLL, "QMMA_MIN_BLOCKS": qg.QMMA_MIN_BLOCKS}
POISON32, POISON16 = np.uint32(0xFFFFFFFF), np.uint16(0xFFFF)
cpu_only = pytest.mark.skipif(cuda_cpu.unavailable_reason() is not None,
                              reason=f"no CPU executor here: {cuda_cpu.unavailable_reason()}")


def weight(rng, N: int, K: int, bits: int, group_size: int) -> QuantizedWeight:
    """quantize_ref of a random W [N, K] with the awkward groups in it: row 0's first group tiny (fp16
    subnormal scales), its second all zeros (scale 1, q == z) and its third all positive (zero point 0)."""
    w = rng.standard_normal((N, K)).astype(np.float32) * np.float32(K ** -0.5)        # [N, K]
    G = K if group_size == -1 else group_size
    w[0, :G] *= np.float32(1e-6)
    if K >= 2 * G:
        w[0, G:2 * G] = 0.0
    if K >= 3 * G:
        w[0, 2 * G:3 * G] = np.abs(w[0, 2 * G:3 * G])
    return quantize_ref(w, bits, group_size)


def activations(rng, T: int, K: int, ldx: int) -> tuple[np.ndarray, np.ndarray]:
    """(bf16 bits [T, ldx], whose first K columns are x; float32 x [T, K] of exactly those values)."""
    bits = f32_to_bf16(rng.standard_normal((T, ldx)).astype(np.float32))              # [T, ldx]
    return bits, bf16_to_f32(bits[:, :K])


def assert_close(got: np.ndarray, x: np.ndarray, qw: QuantizedWeight, K: int, tensor_cores: bool = False) -> None:
    """got [T, N] against x @ W^T within a bound relative to |x| @ |W|^T (the magnitude of the terms: a
    sum that cancels is held to its terms' size, not its own). W: dequantize_ref (the CUDA-core kernel),
    or mma_weight_ref (the tensor-core kernel's bf16 W) when `tensor_cores`."""
    w = qg.mma_weight_ref(qw) if tensor_cores else dequantize_ref(qw)                     # [N, K]
    want = quant_linear_ref(x, qw) if not tensor_cores else x @ w.T                       # [T, N]
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert np.isfinite(got).all(), "a NaN or inf: an output never written (the poison) or a bad scale"
    bound = 1e-5 * max(1.0, K / 2048) * magnitude + 1e-30
    worst = np.unravel_index(np.argmax(np.abs(got - want) / bound), got.shape)
    assert (np.abs(got - want) <= bound).all(), f"at {worst}: got {got[worst]!r}, want {want[worst]!r}"


# ---- CPU executor ---------------------------------------------------------------------------------
def run_on_cpu(kernel: str, grid: int, block: int, inputs: dict, args, want_shape, bits_dtype, poison):
    """The raw output bits [rows * cols + guard] of one launch of `kernel` on the CPU executor."""
    so = cuda_cpu.build(SOURCE.read_text(), str(SOURCE.relative_to(KERNELS_DIR.parent)), kernel, DEFINES)
    case = Case(label=kernel, grid=(grid,), block=block, inputs=inputs, args=args, out_dtype="f32",
                want=np.zeros(want_shape, np.float32))
    outcome = cuda_cpu.run_case(so, kernel, case, 1, poison, bits_dtype)
    assert outcome.crash is None, outcome.crash
    bits = outcome.runs[0]
    n = int(np.prod(want_shape))
    assert (bits[n:] == poison).all(), "a write past the end of the output"
    return bits[:n].reshape(want_shape)


def vector_path_fits(bits: int, K: int, G: int) -> bool:
    per_chunk = qg.CHUNK_BYTES * 8 // bits
    return K % per_chunk == 0 and G % per_chunk == 0


# (N, K, group size): one row; N neither a multiple of the block's rows nor of the 32 lanes; K of one
# chunk per lane, of partial main-loop steps, of a whole step and a tail (576 int4 = 18 chunks);
# groups of 8 (only the word-at-a-time kernel), one group per row (-1), groups smaller than a chunk
SHAPES = [(1, 64, 32), (5, 96, -1), (33, 64, 8), (9, 576, 64), (3, 2048, 128)]
GEMV_CASES = [(bits, T, N, K, G, vec) for bits in (4, 8) for (N, K, G) in SHAPES for T in (1, 3, 8)
              for vec in (True, False) if not vec or vector_path_fits(bits, K, K if G == -1 else G)]


@cpu_only
@pytest.mark.parametrize("bits,T,N,K,G,vec", GEMV_CASES,
                         ids=[f"int{b}-T{t}-N{n}-K{k}-G{g}-{'vec' if v else 'words'}" for b, t, n, k, g, v in GEMV_CASES])
def test_quant_gemv_on_the_cpu_executor(bits, T, N, K, G, vec):
    rng = np.random.default_rng(bits * 1000 + T * 100 + N + K)
    qw = weight(rng, N, K, bits, G)
    ldx = K + (8 if vec else 3)                          # a row stride: 16-byte rows, or odd ones
    x_bits, x = activations(rng, T, K, ldx)
    name = f"quant_gemv_int{bits}" + ("" if vec else "_unaligned")
    got = run_on_cpu(name, -(-N // qg.QGEMV_WARPS), 32 * qg.QGEMV_WARPS,
                     {"x": x_bits, "qweight": qw.qweight, "scales": qw.scales.view(np.uint16), "zeros": qw.zeros},
                     lambda d: (d["x"], np.int64(ldx), d["qweight"], d["scales"], d["zeros"], d["out"],
                                np.int64(N), np.int32(T), np.int32(N), np.int32(K), np.int32(qw.group_size)),
                     (T, N), np.uint32, POISON32)
    assert_close(got.view(np.float32), x, qw, K)


DEQUANT_CASES = [(bits, N, K, G) for bits in (4, 8) for (N, K, G) in SHAPES[:4]]


@cpu_only
@pytest.mark.parametrize("bits,N,K,G", DEQUANT_CASES, ids=[f"int{b}-N{n}-K{k}-G{g}" for b, n, k, g in DEQUANT_CASES])
def test_dequantize_is_bf16_of_the_reference_bit_for_bit_on_the_cpu_executor(bits, N, K, G):
    qw = weight(np.random.default_rng(N + K + bits), N, K, bits, G)
    words = qw.qweight.size
    got = run_on_cpu(f"dequantize_bf16_int{bits}", -(-words // qg.DEQUANT_THREADS), qg.DEQUANT_THREADS,
                     {"qweight": qw.qweight, "scales": qw.scales.view(np.uint16), "zeros": qw.zeros},
                     lambda d: (d["qweight"], d["scales"], d["zeros"], d["out"], np.int32(N), np.int32(K),
                                np.int32(qw.group_size)),
                     (N, K), np.uint16, POISON16)
    np.testing.assert_array_equal(got, f32_to_bf16(dequantize_ref(qw)))


def test_supported_is_a_cheap_shape_and_dtype_check():
    qw = quantize_ref(np.ones((4, 64), np.float32), 4, 32)
    assert qg.supported(np.zeros((1, 64), np.uint16), qw)
    assert qg.supported(np.zeros((16, 64), np.uint16), qw, np.zeros((16, 4), np.float32))
    assert not qg.supported(np.zeros((17, 64), np.uint16), qw)                   # prefill: dequantize + GEMM
    assert not qg.supported(np.zeros((1, 64), np.float32), qw)
    assert not qg.supported(np.zeros((1, 32), np.uint16), qw)
    assert not qg.supported(np.zeros((1, 64), np.uint16), qw, np.zeros((1, 4), np.uint16))


# ---- GPU ------------------------------------------------------------------------------------------
def to_device(qw: QuantizedWeight) -> QuantizedWeight:
    import cupy as cp
    return QuantizedWeight(cp.asarray(qw.qweight), cp.asarray(qw.scales), cp.asarray(qw.zeros), qw.bits,
                           qw.group_size, qw.shape)


# Llama-3.2-1B's projections (qkv, o, gate_up, down), group 128
LLAMA_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("N,K", LLAMA_1B)
def test_quant_gemv_on_the_model_shapes_for_every_row_count(N, K, bits):
    import cupy as cp
    rng = np.random.default_rng(N + K + bits)
    qw = weight(rng, N, K, bits, 128)
    dev = to_device(qw)
    x_bits, x = activations(rng, qg.QMMA_MAX_ROWS, K, K)
    xd = cp.asarray(x_bits)
    assert qg.uses_tensor_cores(xd, dev)
    for T in range(1, qg.QMMA_MAX_ROWS + 1):
        out = cp.full((T, N), np.nan, dtype=cp.float32)                    # poisoned: unwritten stays NaN
        assert qg.quant_gemv(xd[:T], dev, out) is out
        assert_close(out.get(), x[:T], qw, K, tensor_cores=True)
    np.testing.assert_array_equal(qg.dequantize_bf16(dev).get(), f32_to_bf16(dequantize_ref(qw)))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("N,K,G,ldx,offset", [
    (5, 96, 32, 96, 0),         # the 16-byte kernel on a small shape
    (37, 200, 8, 200, 0),       # K not a whole number of chunks, groups smaller than a chunk
    (40, 576, 64, 577, 0),      # x rows not 16-byte aligned
    (40, 576, 64, 576, 1),      # x a view starting one element in
    (1001, 1536, -1, 1600, 8),  # one group per row, a strided aligned view
])
def test_quant_gemv_unaligned_and_strided(bits, N, K, G, ldx, offset):
    import cupy as cp
    rng = np.random.default_rng(N * bits + K)
    qw = weight(rng, N, K, bits, G)
    x_bits, _ = activations(rng, 3, offset + K, offset + ldx)
    x = bf16_to_f32(x_bits[:, offset:offset + K])
    xd = cp.asarray(x_bits)[:, offset:offset + K]
    out = cp.full((3, N), np.nan, dtype=cp.float32)
    dev = to_device(qw)
    qg.quant_gemv(xd, dev, out)
    assert_close(out.get(), x, qw, K, tensor_cores=qg.uses_tensor_cores(xd, dev))
    np.testing.assert_array_equal(qg.dequantize_bf16(to_device(qw)).get(), f32_to_bf16(dequantize_ref(qw)))


@pytest.mark.gpu
def test_prefill_dequantize_then_gemm():
    """T > QMMA_MAX_ROWS: the scratch bf16 W times x through cuBLAS, as bf16 weights would be."""
    import cupy as cp

    from engine.backend import matmul
    rng = np.random.default_rng(3)
    qw = weight(rng, 3072, 2048, 4, 128)
    x_bits, x = activations(rng, 37, 2048, 2048)
    scratch = cp.empty((3072, 2048), dtype=cp.uint16)
    w = qg.dequantize_bf16(to_device(qw), scratch)
    assert w is scratch
    out = cp.empty((37, 3072), dtype=cp.float32)
    matmul(cp.asarray(x_bits), w, out, trans_b=True)
    want = x.astype(np.float64) @ bf16_to_f32(f32_to_bf16(dequantize_ref(qw))).astype(np.float64).T
    np.testing.assert_allclose(out.get(), want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))


@pytest.mark.gpu
def test_quant_gemv_rejects_what_it_cannot_take():
    import cupy as cp
    dev = to_device(weight(np.random.default_rng(0), 8, 64, 4, 32))
    for x, what in [(cp.zeros((17, 64), cp.uint16), "1 to 16 rows"), (cp.zeros((1, 64), cp.float32), "bf16 bits"),
                    (cp.zeros((1, 32), cp.uint16), "bf16 bits")]:
        with pytest.raises(qg.QuantGemvInputError, match=what):
            qg.quant_gemv(x, dev)
    with pytest.raises(qg.QuantGemvInputError, match="out must be float32"):
        qg.quant_gemv(cp.zeros((1, 64), cp.uint16), dev, cp.zeros((1, 8), cp.uint16))
    strided = QuantizedWeight(cp.zeros((8, 16), cp.uint32)[:, ::2], dev.scales, dev.zeros, 4, 32, (8, 64))
    with pytest.raises(qg.QuantGemvInputError, match="qweight must be a contiguous"):
        qg.quant_gemv(cp.zeros((1, 64), cp.uint16), strided)


@pytest.mark.gpu
def test_quant_gemv_replays_from_a_cuda_graph():
    """Captured once (no allocation, no host sync inside), replayed on new inputs."""
    import cupy as cp
    rng = np.random.default_rng(11)
    qw = weight(rng, 3072, 2048, 4, 128)
    dev = to_device(qw)
    x_bits, _ = activations(rng, 4, 2048, 2048)
    xd = cp.asarray(x_bits)
    pool, stream = cp.cuda.MemoryPool(), cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        qg.quant_gemv(xd, dev)          # warm-up: compiles; its output goes back to the pool for the capture
        stream.synchronize()
        stream.begin_capture()
        out = qg.quant_gemv(xd, dev)
        graph = stream.end_capture()
    for seed in (1, 2):
        x2_bits, x2 = activations(np.random.default_rng(seed), 4, 2048, 2048)
        xd[...] = cp.asarray(x2_bits)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        assert_close(out.get(), x2, qw, 2048, tensor_cores=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 13])
def test_a_plugged_in_kernel_replaces_the_int4_gemv(T):
    """The engine's own CUDA-core kernel as a learner's `quant_gemv` stage: int4 projections run it (8 rows
    per launch, fp32 sums: quant_linear_ref's W), int8 ones keep the engine's tensor-core kernel."""
    import cupy as cp

    import engine
    rng = np.random.default_rng(T)
    qw4, qw8 = weight(rng, 300, 1024, 4, 128), weight(rng, 300, 1024, 8, 128)
    x_bits, x = activations(rng, T, 1024, 1024)
    xd = cp.asarray(x_bits)
    with engine.use_stage("quant_gemv", cuda_source=SOURCE.read_text(), kernel="quant_gemv_int4"):
        assert not qg.uses_tensor_cores(xd, to_device(qw4))
        assert_close(qg.quant_gemv(xd, to_device(qw4)).get(), x, qw4, 1024)
        assert_close(qg.quant_gemv(xd, to_device(qw8)).get(), x, qw8, 1024, tensor_cores=True)
