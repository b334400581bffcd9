"""Sampling: turning a row of logits into the next token (chapter 08).

`SamplingParams` is the user-facing knob set; `sample_numpy` is the readable reference that the
GPU kernel in kernels_cu/sampling.cu reproduces. Temperature 0 means greedy (argmax).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from engine.backend import is_device_array, load_kernel
from engine.ops.argmax import argmax_rows


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Invalid values raise ValueError at construction."""

    max_new_tokens: int = 256
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = no top-k cut
    top_p: float = 1.0         # 1 = no nucleus cut
    seed: int | None = None    # same seed, same tokens
    ignore_eos: bool = False   # keep generating past eos (benchmarks)
    stop: tuple[str, ...] = ()  # stop strings: the text ends just before the first one that appears


    def __post_init__(self):
        def is_int(v):      # Python or NumPy integers, never bools
            return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, numbers.Real) or isinstance(self.temperature, (bool, np.bool_)) \
                or not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, numbers.Real) or isinstance(self.top_p, (bool, np.bool_)) \
                or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        # One string or a list of them, as in OpenAI's `stop`; stored as a tuple (the dataclass is frozen).
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        # NumPy scalars pass the checks above; store plain Python numbers so that nothing downstream
        # (the scheduler's int checks, the seed arithmetic, JSON) meets a fixed-width type.
        for name, cast in (("max_new_tokens", int), ("temperature", float), ("top_k", int), ("top_p", float)):
            object.__setattr__(self, name, cast(getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ----------------------------------------------------------------------------------------------
# The draw: one uniform number per (request, step), from the request's seed
# ----------------------------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1


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


def sample(logits, params: list[SamplingParams], uniforms: list[float]) -> np.ndarray:
    """One token per row of logits [R, V] -> int32 [R] on the host.

    On the GPU only the R sampled ids cross to the host (argmax kernel when every row is greedy,
    the sampling kernel otherwise).
    """
    R = len(params)
    if not is_device_array(logits):
        return np.array([sample_ref(logits[r], p.temperature, p.top_k, p.top_p, u)
                         for r, (p, u) in enumerate(zip(params, uniforms, strict=True))], dtype=np.int32)
    import cupy as cp
    if all(p.greedy for p in params):
        return cp.asnumpy(argmax_rows(logits))
    V = logits.shape[1]
    knobs = [cp.asarray(np.array(v, dtype=dt)) for v, dt in (
        ([p.temperature for p in params], np.float32), ([p.top_k for p in params], np.int32),
        ([p.top_p for p in params], np.float32), (uniforms, np.float32))]
    out = cp.empty(R, dtype=cp.int32)
    load_kernel("sampling", "sample_rows")((R,), (1024,), (logits, *knobs, out, np.int32(V)))
    return cp.asnumpy(out)
