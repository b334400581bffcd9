"""Sampling: turning a row of logits into the next token (chapter 08).

`SamplingParams` is the user-facing knob set; `sample_ref` is the readable reference that the
GPU kernel in kernels_cu/sampling.cu reproduces. Temperature 0 means greedy (argmax).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from engine.backend import is_device_array, load_kernel
from engine.ops.argmax import argmax_rows
from engine.plugins import OVERRIDES, to_host

SAMPLE_THREADS = 1024   # threads per row of kernels_cu/sampling.cu (passed to it as -DTHREADS)


def _is_int(v) -> bool:
    """Python or NumPy integers; never bools (True is not a count) and never floats (3.0 included:
    one rule for every float, rather than accepting the integral ones and refusing 3.5)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


_INT32_MAX = 2**31 - 1
_F32_NORMAL = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Invalid values raise ValueError at construction.

    Counts (max_new_tokens, top_k, seed) take any integer type, NumPy's included, and are stored as
    Python ints; floats are refused even when integral (3.0). Numbers (temperature, top_p) take any
    real type and are stored as Python floats. ignore_eos takes a bool (NumPy's included).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = no top-k cut
    top_p: float = 1.0         # 1 = no nucleus cut
    seed: int | None = None    # same seed, same tokens
    ignore_eos: bool = False   # keep generating past eos (benchmarks)
    stop: tuple[str, ...] = ()  # stop strings: the text ends just before the first one that appears


    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        # the samplers divide by temperature in float32: a positive value must stay positive and finite there
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) \
                or not (self.temperature == 0 or _F32_NORMAL[0] <= self.temperature <= _F32_NORMAL[1]):
            raise ValueError(f"temperature must be 0 (greedy) or in [{_F32_NORMAL[0]:.3g}, {_F32_NORMAL[1]:.3g}], "
                             f"got {self.temperature!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be an integer in [0, {_INT32_MAX}] (0 disables it), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MASK64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        # One string or a list of them, as in OpenAI's `stop`; stored as a tuple (the dataclass is frozen).
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        normalized = {"max_new_tokens": int(self.max_new_tokens), "temperature": float(self.temperature),
                      "top_k": int(self.top_k), "top_p": float(self.top_p),
                      "seed": None if self.seed is None else int(self.seed), "ignore_eos": bool(self.ignore_eos),
                      "stop": tuple(stop)}
        for name, value in normalized.items():      # plain Python values from here on
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ----------------------------------------------------------------------------------------------
# The draw: one uniform number per (request, step), from the request's seed
# ----------------------------------------------------------------------------------------------

def step_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, step): splitmix64 of the pair.

    Stateless on purpose: a request that is preempted and recomputed, or a batch that failed and
    is retried, draws the same number for the same step, so seeded sampling stays reproducible.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def step_uniforms(seeds, steps) -> np.ndarray:
    """step_uniform for many rows at once: float64 [R], bit for bit the same numbers.

    seeds: R seeds in [0, 2**64); steps: R step numbers. uint64 arithmetic wraps modulo 2**64, which
    is exactly the `& _MASK64` of the scalar version; (z >> 11) has 53 bits, exact in a float64.
    """
    z = np.asarray(seeds, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) \
        + (np.asarray(steps, dtype=np.uint64) + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def resolve_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a fresh random one."""
    return params.seed if params.seed is not None else int(np.random.SeedSequence().entropy) & _MASK64


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


def start_sampling(logits, params: list[SamplingParams], uniforms) -> SampledTokens:
    """Queue the sampling of one token per row of logits [R, V]; SampledTokens.wait() gives them.

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
            plug.require_function()
            draw = plug.fn
        rows = to_host(logits)
        finite = np.isfinite(rows).all(axis=1)
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
    both = cp.stack([tokens, cp.isfinite(logits).all(axis=1).astype(cp.int32)])   # [2, R]: one copy
    pinned = cp.cuda.alloc_pinned_memory(both.nbytes)
    host = np.frombuffer(pinned, np.int32, both.size).reshape(2, R)
    stream = cp.cuda.get_current_stream()
    cp.cuda.runtime.memcpyAsync(host.ctypes.data, both.data.ptr, both.nbytes,
                                cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
    copied = cp.cuda.Event(disable_timing=True)
    copied.record(stream)
    return SampledTokens(host[0], host[1], device=tokens, copied=copied, keep=(pinned, both))


def sample(logits, params: list[SamplingParams], uniforms, labels=None) -> np.ndarray:
    """One token per row of logits [R, V] -> int32 [R] on the host: start_sampling(...).wait(labels).

    labels: R row names for the error below (any sequence: llm.RowLabels formats them only when one
    is needed). A row with NaN or inf raises NonFiniteLogitsError (naming it by `labels`): greedy
    would pick an arbitrary id and sampling the last one.
    """
    return start_sampling(logits, params, uniforms).wait(labels)
