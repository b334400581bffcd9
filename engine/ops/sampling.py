"""Sampling's device half (chapter 08): one token per row of logits, on the backend.

`sample_ref` is the readable reference that the kernel in kernels_cu/sampling.cu reproduces: the
kept tokens (top-k, then top-p) and an inverse CDF over them with one uniform draw per row.
Temperature 0 means greedy (argmax, kernels_cu/argmax.cu). The request-level knobs and the draws
live in engine/runtime/sampling_params.py; anything with .temperature, .top_k, .top_p and .greedy
describes a row here.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from engine.backend import is_device_array, load_kernel
from engine.ops.argmax import argmax_rows
from engine.plugins import OVERRIDES, to_host

SAMPLE_THREADS = 1024   # threads per row of kernels_cu/sampling.cu (passed to it as -DTHREADS)


class RowKnobs(Protocol):
    """What sampling reads of a row's SamplingParams."""
    @property
    def temperature(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def top_p(self) -> float: ...

    @property
    def greedy(self) -> bool: ...


# ----------------------------------------------------------------------------------------------
# The NumPy reference (what kernels_cu/sampling.cu computes)
# ----------------------------------------------------------------------------------------------

def keep_mask(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(p, keep) for one row: p = exp((z - max z) / T) unnormalized, keep = the tokens that survive
    top-k (ties at the k-th value kept) and then top-p (smallest top set holding top_p of the mass)."""
    z = logits.astype(np.float32)
    if temperature == 0:
        p = (z == z.max()).astype(np.float32)
        return p, p > 0
    p = np.exp((z - z.max()) / np.float32(temperature)).astype(np.float32)
    keep = np.ones(p.shape, dtype=bool)
    if 0 < top_k < p.size:
        keep = p >= np.partition(p, p.size - top_k)[p.size - top_k]
    if top_p < 1.0:
        kept = np.sort(p[keep])[::-1]
        cum = np.cumsum(kept, dtype=np.float64)     # float64: a float32 running sum over 128k terms drifts
        n = int(np.searchsorted(cum, top_p * cum[-1], side="left"))
        keep &= p >= kept[min(n, kept.size - 1)]
    return p, keep


def sample_ref(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """Inverse CDF over the kept tokens in index order; temperature 0 returns the first argmax."""
    p, keep = keep_mask(logits, temperature, top_k, top_p)
    mass = np.where(keep, p, np.float32(0))
    cum = np.cumsum(mass, dtype=np.float64)         # the exact CDF the GPU's blocked scan approximates
    if temperature == 0:
        u = 0.0
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return i if i < p.size and keep[i] else int(np.flatnonzero(keep)[-1])


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or an infinity: nothing can be sampled from that row."""


def check_finite_rows(finite, labels=None) -> None:
    """Raise NonFiniteLogitsError naming every row whose logits were not all finite.

    finite: [R] bool on the host; labels: what to call each row (e.g. "request 3, step 7").
    """
    bad = np.flatnonzero(~np.asarray(finite, dtype=bool))
    if bad.size:
        names = [labels[r] if labels is not None else f"row {r}" for r in bad[:5]]
        raise NonFiniteLogitsError(f"non-finite logits (NaN or inf) for {'; '.join(names)}"
                                   f"{' and more' if bad.size > 5 else ''}: the model's numbers overflowed, or it "
                                   "was fed a token id it has no embedding for")


class SampledTokens:
    """The ids one step sampled. `ids` ([R] int32 on the backend) exists at once, on the GPU before
    the step has even run: async scheduling feeds it to the next step's inputs without a round trip
    through the host. wait() returns them on the host ([R] int32), after checking that every row's
    logits were finite (NonFiniteLogitsError names the bad rows by `labels`)."""

    def __init__(self, host: np.ndarray, finite: np.ndarray, device=None, copied=None, keep=()):
        self._host, self._finite = host, finite    # [R] int32, [R] (filled when `copied` fires)
        self.ids = host if device is None else device
        self._copied = copied                      # CUDA event after the device-to-host copy
        self._keep = keep                          # buffers the copy reads and writes, alive until then

    def wait(self, labels=None, checked=None) -> np.ndarray:
        """checked: [R] bool, the rows whose logits must be finite (default: all; async scheduling
        leaves out rows whose request ended while the step was in flight: their tokens are dropped)."""
        if self._copied is not None:
            self._copied.synchronize()
        finite = self._finite.astype(bool)
        if checked is not None:
            finite |= ~np.asarray(checked, dtype=bool)
        check_finite_rows(finite, labels)
        return self._host.copy()


def start_sampling(logits, params: Sequence[RowKnobs], uniforms, raw=None) -> SampledTokens:
    """Queue the sampling of one token per row of logits [R, V]; SampledTokens.wait() gives them.

    raw: the model's logits before processing (engine/ops/logits_processing.py), whose rows must be
    finite; a processed row may hold -inf (a token masked out) and still be sampled.

    uniforms: R draws in [0, 1) (a list or a float64 array, step_uniforms). On the GPU only the R
    sampled ids and R finite flags cross to the host, in one asynchronous copy into pinned memory
    (argmax kernel when every row is greedy, the sampling kernel otherwise); on the CPU, and with a
    learner's sampling function plugged in, the ids are drawn at once.
    """
    R = len(params)
    plug = OVERRIDES.get("sampling")             # your stage (engine/plugins.py), if one is active
    if (plug is not None and plug.fn is not None) or not is_device_array(logits):
        draw = sample_ref
        if plug is not None:
            draw = plug.require_function()
        rows = to_host(logits)
        finite = np.isfinite(rows if raw is None else to_host(raw)).all(axis=1)
        return SampledTokens(np.array([int(draw(rows[r], p.temperature, p.top_k, p.top_p, u)) if finite[r] else 0
                                       for r, (p, u) in enumerate(zip(params, uniforms, strict=True))],
                                      dtype=np.int32), finite)
    import cupy as cp
    if plug is None and all(p.greedy for p in params):
        tokens = argmax_rows(logits)
    else:
        V = logits.shape[1]
        knobs = [cp.asarray(np.array(v, dtype=dt)) for v, dt in (
            ([p.temperature for p in params], np.float32), ([p.top_k for p in params], np.int32),
            ([p.top_p for p in params], np.float32), (uniforms, np.float32))]
        tokens = cp.empty(R, dtype=cp.int32)
        defines = {"THREADS": SAMPLE_THREADS}
        kernel = plug.kernel(**defines) if plug is not None else load_kernel("sampling", "sample_rows", **defines)
        kernel((R,), (SAMPLE_THREADS,), (logits, *knobs, tokens, np.int32(V)))
    tokens = tokens.astype(cp.int32, copy=False)
    finite = cp.isfinite(logits if raw is None else raw).all(axis=1)
    both = cp.stack([tokens, finite.astype(cp.int32)])   # [2, R]: one copy
    pinned = cp.cuda.alloc_pinned_memory(both.nbytes)
    host = np.frombuffer(pinned, np.int32, both.size).reshape(2, R)
    stream = cp.cuda.get_current_stream()
    cp.cuda.runtime.memcpyAsync(host.ctypes.data, both.data.ptr, both.nbytes,
                                cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
    copied = cp.cuda.Event(disable_timing=True)
    copied.record(stream)
    return SampledTokens(host[0], host[1], device=tokens, copied=copied, keep=(pinned, both))


def sample(logits, params: Sequence[RowKnobs], uniforms, labels=None) -> np.ndarray:
    """One token per row of logits [R, V] -> int32 [R] on the host: start_sampling(...).wait(labels).

    labels: R row names for the error below (any sequence: model_runner.RowLabels formats them only when one
    is needed). A row with NaN or inf raises NonFiniteLogitsError (naming it by `labels`): greedy
    would pick an arbitrary id and sampling the last one.
    """
    return start_sampling(logits, params, uniforms).wait(labels)
