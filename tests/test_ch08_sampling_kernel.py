"""The sampling kernel (kernels_cu/sampling.cu) against sample_ref, on the CPU executor (the same CUDA
source compiled for the host, 1,024 threads per row as on the GPU): the top-k fast path (candidates
gathered above the k-th largest of the threads' local maxima, sorted in shared memory, top-p summed
over them), and the binary-search path it falls back to (top-p alone, k above the block, too many
candidates, a tie in p reaching past them), greedy rows, masked (-inf) logits. The output row is the
sampled ids; the same uniform draw must give the reference's token, in every thread order the
executor tries (the candidates land in shared memory in atomic order; the sort makes it one order)."""
import numpy as np
import pytest

from engine.backend import KERNELS_DIR
from engine.exercises.cuda_check import Case
from engine.exercises.cuda_cpu import executor as cuda_cpu
from engine.ops.sampling import SAMPLE_THREADS, sample_ref

SOURCE = KERNELS_DIR / "sampling.cu"
pytestmark = pytest.mark.skipif(cuda_cpu.unavailable_reason() is not None,
                                reason=f"no CPU executor here: {cuda_cpu.unavailable_reason()}")

# (name, V, temperature, top_k, top_p, logits): 8 rows each, one uniform draw per row
CASES = [
    ("top-k and top-p (fast path)", 3001, 0.8, 50, 0.95, "normal"),
    ("top-k alone (fast path)", 2500, 1.0, 20, 1.0, "normal"),
    ("k = 1 at temperature 1", 700, 1.0, 1, 1.0, "normal"),
    ("top-p alone (binary search)", 3001, 1.0, 0, 0.9, "normal"),
    ("k above the block (binary search)", 3001, 0.7, 1500, 0.8, "normal"),
    ("ties everywhere (too many candidates)", 5000, 1.0, 40, 0.9, "ties"),
    ("masked logits", 1800, 0.9, 30, 0.9, "masked"),
    ("greedy", 3001, 0.0, 0, 1.0, "normal"),
]


def logits_for(kind: str, rng, R: int, V: int) -> np.ndarray:
    z = (rng.standard_normal((R, V)) * 3).astype(np.float32)        # [R, V]
    if kind == "ties":
        z = np.round(z).astype(np.float32)                          # a dozen distinct values per row
    if kind == "masked":
        z[:, rng.permutation(V)[: V - 40]] = -np.inf                # 40 tokens allowed
    return z


@pytest.mark.parametrize("name,V,temperature,top_k,top_p,kind", CASES, ids=[c[0] for c in CASES])
def test_the_kernel_draws_the_reference_token(name, V, temperature, top_k, top_p, kind):
    R = 8
    rng = np.random.default_rng(V + top_k)
    z = logits_for(kind, rng, R, V)
    u = rng.random(R).astype(np.float32)
    knobs = {"logits": z, "temperature": np.full(R, temperature, np.float32), "top_k": np.full(R, top_k, np.int32),
             "top_p": np.full(R, top_p, np.float32), "uniform": u}
    so = cuda_cpu.build(SOURCE.read_text(), "kernels_cu/sampling.cu", "sample_rows", {"THREADS": SAMPLE_THREADS})
    case = Case(label=name, grid=(R,), block=SAMPLE_THREADS, inputs=knobs, out_dtype="f32",
                args=lambda d: (d["logits"], d["temperature"], d["top_k"], d["top_p"], d["uniform"], d["out"],
                                np.int32(V)),
                want=np.zeros((1, R), np.float32))
    outcome = cuda_cpu.run_case(so, "sample_rows", case, 3, np.int32(-7), np.int32)   # three thread orders
    assert outcome.crash is None, outcome.crash
    want = [sample_ref(z[r], temperature, top_k, top_p, float(u[r])) for r in range(R)]
    for run in outcome.runs:
        assert run[:R].tolist() == want
