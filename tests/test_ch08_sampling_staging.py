"""What sampling moves between host and device each step (engine/ops/sampling.py): one asynchronous copy of
the rows' knobs from a pinned buffer, one back of the ids and finite flags, the pinned buffers pooled and
reused only once SampledTokens.wait() has seen a step's copies land. The GPU tests check that the host
never waits for the work queued before it (a copy from pageable memory would), that steps in flight
together never share a buffer, and that every draw is still the reference's."""
import numpy as np
import pytest

from engine.ops import sampling
from engine.ops.sampling import NonFiniteLogitsError, SampledTokens, sample_ref, start_sampling
from engine.runtime.sampling_params import SamplingParams, step_uniforms


class LandedCopy:
    """Stands for the CUDA event of a copy that has landed."""
    def synchronize(self):
        pass


def test_wait_gives_the_pinned_buffer_back_once_and_keeps_its_own_copy(monkeypatch):
    monkeypatch.setattr(sampling, "_FREE_STAGING", [])
    R = 3
    staging = np.zeros(sampling.STEP_WORDS * R, np.int32)   # [tokens | finite | knobs], as on the GPU
    staging[:2 * R] = [7, 8, 9, 1, 0, 1]
    step = SampledTokens(staging[:R], staging[R:2 * R], device="ids", copied=LandedCopy(), staging=staging)
    assert step.wait(checked=[True, False, True]).tolist() == [7, 8, 9]
    assert len(sampling._FREE_STAGING) == 1 and sampling._FREE_STAGING[0] is staging
    staging[:] = -1                                          # the next step writes the buffer
    assert step.wait(checked=[True, False, True]).tolist() == [7, 8, 9]
    with pytest.raises(NonFiniteLogitsError, match="row 1"):
        step.wait()
    assert len(sampling._FREE_STAGING) == 1                  # given back once only


# ---------------------------------------------------------------------------------------------- GPU

SPIN = r'''extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}'''

KNOBS = [SamplingParams(), SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
         SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_k=5)]


def batch(R: int, V: int, seed: int, greedy: bool = False):
    """(logits [R, V] on the host, params, uniforms) of a batch mixing the knobs above."""
    logits = (np.random.default_rng(seed).standard_normal((R, V)) * 3).astype(np.float32)
    params = [KNOBS[0] if greedy else KNOBS[r % len(KNOBS)] for r in range(R)]
    return logits, params, step_uniforms(np.arange(R) + seed, np.full(R, seed))


def reference(logits, params, uniforms) -> list[int]:
    u32 = np.asarray(uniforms, np.float32)                   # the kernel's draw is the float32 rounding
    return [sample_ref(logits[r], p.temperature, p.top_k, p.top_p, float(u32[r])) for r, p in enumerate(params)]


@pytest.mark.gpu
def test_gpu_steps_in_flight_together_get_their_own_buffers_and_the_reference_tokens():
    import cupy as cp
    batches = [batch(R, 1001, seed) for seed, R in enumerate([3, 40, 5, 300, 256])]   # 300 grows the buffers
    steps = [start_sampling(cp.asarray(z), params, u) for z, params, u in batches]   # all in flight at once
    assert len({id(step._staging) for step in steps}) == len(steps)
    for step, (z, params, u) in reversed(list(zip(steps, batches))):
        assert step.wait().tolist() == reference(z, params, u)
        assert step.ids.get().tolist() == reference(z, params, u)
    pooled = {id(buffer) for buffer in sampling._FREE_STAGING}
    again = [start_sampling(cp.asarray(z), params, u) for z, params, u in batches[:2]]
    assert {id(step._staging) for step in again} <= pooled                           # reused, not allocated
    assert [step.wait().tolist() for step in again] == [reference(*b) for b in batches[:2]]


@pytest.mark.gpu
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_gpu_finite_flags_come_from_the_raw_logits_and_checked_rows(greedy):
    import cupy as cp
    z, params, u = batch(4, 1001, 3, greedy)
    processed = z.copy()
    processed[:, :900] = -np.inf                             # masked tokens: the raw row is what must be finite
    want = reference(processed, params, u)
    assert start_sampling(cp.asarray(processed), params, u, raw=cp.asarray(z)).wait().tolist() == want
    z[2, 17] = np.nan
    step = start_sampling(cp.asarray(processed), params, u, raw=cp.asarray(z))
    with pytest.raises(NonFiniteLogitsError, match="request 2"):
        step.wait(labels=[f"request {r}" for r in range(4)])
    got = step.wait(checked=[True, True, False, True])
    assert got[[0, 1, 3]].tolist() == [want[r] for r in (0, 1, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_gpu_start_sampling_never_waits_for_the_work_queued_before_it(greedy):
    """Async scheduling queues a step's sampling while the step before it still runs: nothing here may
    wait for the device (a copy from pageable memory, a read of a device value)."""
    import cupy as cp
    z, params, u = batch(256, 4096, 5, greedy)
    logits = cp.asarray(z)
    start_sampling(logits, params, u).wait()                 # compiled, and a buffer in the pool
    cp.RawKernel(SPIN, "spin")((1,), (1,), (np.int64(2**30),))   # ~0.5 s of device time queued first
    spun = cp.cuda.Event(disable_timing=True)
    spun.record()
    step = start_sampling(logits, params, u)
    assert not spun.done, "start_sampling waited for the device"
    assert step.wait().tolist() == reference(z, params, u)
