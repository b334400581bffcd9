"""Sampling: turning a row of logits into the next token (chapter 08).

`SamplingParams` is the user-facing knob set; `sample_numpy` is the readable reference that the
GPU kernel in kernels_cu/sampling.cu reproduces. Temperature 0 means greedy (argmax).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Invalid values raise ValueError at construction."""

    max_new_tokens: int = 256
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = no top-k cut
    top_p: float = 1.0         # 1 = no nucleus cut
    seed: int | None = None    # same seed, same tokens
    ignore_eos: bool = False   # keep generating past eos (benchmarks)

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
