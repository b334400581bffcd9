"""How a request is decoded (chapter 08): `SamplingParams`, the user-facing knob set, and the
seeded uniform draw of each (request, step). Temperature 0 means greedy (argmax). The draw itself,
one token per row of logits, is sampling's device half: engine/ops/sampling.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.checks import is_int, is_real

_INT32_MAX = 2**31 - 1
_F32_NORMAL = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))
_MASK64 = (1 << 64) - 1
MAX_LOGPROBS = 20       # alternatives per token (OpenAI's top_logprobs bound)


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
    # logits processing before the draw (engine/ops/logits_processing.py; OpenAI's and vLLM's names)
    presence_penalty: float = 0.0     # minus this for every token the output holds already
    frequency_penalty: float = 0.0    # minus this times its count in the output
    repetition_penalty: float = 1.0   # a prompt or output token's logit divided by it (times it if negative)
    min_p: float = 0.0                # drop tokens below min_p times the most likely one's probability
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit); a dict is accepted
    # structured output: ("regex", pattern) | ("choice", [str, ...]) | ("json_schema", schema) |
    # ("json_object", None), compiled over the tokenizer's vocabulary (engine/structured/)
    structured: tuple | None = None
    # log-probabilities of each generated token (and of the `logprobs` most likely alternatives), from
    # the model's own distribution: the log-softmax of its logits before any processing or temperature
    logprobs: int | None = None
    # what the runner asks of every row of every step, computed once from the fields above:
    # needs_history  its logits depend on the tokens so far (penalties, a structured output): its rows carry them
    # adjusts_logits logit bias, a penalty or min-p: what process_logits applies row by row
    # processes_logits anything between the model's logits and the draw besides temperature, top-k and top-p
    needs_history: bool = field(init=False, repr=False, compare=False, default=False)
    adjusts_logits: bool = field(init=False, repr=False, compare=False, default=False)
    processes_logits: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self):
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        # the samplers divide by temperature in float32: a positive value must stay positive and finite there
        if not is_real(self.temperature) or not math.isfinite(self.temperature) \
                or not (self.temperature == 0 or _F32_NORMAL[0] <= self.temperature <= _F32_NORMAL[1]):
            raise ValueError(f"temperature must be 0 (greedy) or in [{_F32_NORMAL[0]:.3g}, {_F32_NORMAL[1]:.3g}], "
                             f"got {self.temperature!r}")
        if not is_int(self.top_k) or not 0 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be an integer in [0, {_INT32_MAX}] (0 disables it), got {self.top_k!r}")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= _MASK64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        # One string or a list of them, as in OpenAI's `stop`; stored as a tuple (the dataclass is frozen).
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("repetition_penalty", 0.01, 100.0), ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if not is_real(value) or not lo <= value <= hi:
                raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
        normalized = {"max_new_tokens": int(self.max_new_tokens), "temperature": float(self.temperature),
                      "top_k": int(self.top_k), "top_p": float(self.top_p),
                      "seed": None if self.seed is None else int(self.seed), "ignore_eos": bool(self.ignore_eos),
                      "stop": tuple(stop), "presence_penalty": float(self.presence_penalty),
                      "frequency_penalty": float(self.frequency_penalty),
                      "repetition_penalty": float(self.repetition_penalty), "min_p": float(self.min_p),
                      "logit_bias": _logit_bias(self.logit_bias), "structured": _structured(self.structured),
                      "logprobs": None if self.logprobs is None else int(self.logprobs)}
        penalized = bool(normalized["presence_penalty"] or normalized["frequency_penalty"]
                         or normalized["repetition_penalty"] != 1.0)
        normalized["needs_history"] = penalized or normalized["structured"] is not None
        normalized["adjusts_logits"] = penalized or bool(normalized["logit_bias"]) \
            or (normalized["min_p"] > 0 and normalized["temperature"] > 0)
        normalized["processes_logits"] = normalized["needs_history"] or normalized["adjusts_logits"]
        for name, value in normalized.items():      # plain Python values from here on
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """{token id: bias} or (id, bias) pairs -> sorted pairs; ids >= 0, biases finite in [-100, 100] (OpenAI's range)."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
        token, bias = pair
        if not is_int(token) or not 0 <= token <= _INT32_MAX:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not is_real(bias) or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
        out[int(token)] = float(bias)
    return tuple(sorted(out.items()))


STRUCTURED_KINDS = ("regex", "choice", "json_schema", "json_object")


def _structured(value) -> tuple | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2 or value[0] not in STRUCTURED_KINDS:
        raise ValueError(f"structured must be None or (kind, spec) with kind one of {STRUCTURED_KINDS}, got {value!r}")
    return (value[0], value[1])


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
    if params.seed is not None:
        return params.seed
    entropy = np.random.SeedSequence().entropy    # an int: no entropy was passed in
    return int(entropy) & _MASK64   # type: ignore[arg-type]  # numpy types it int | Sequence[int] | None
