"""Chapter 08 exercises: the cache append, the decode loop, top-p, the draw, KV memory."""
from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable

import numpy as np

from engine.exercises import call_learner, check_cases
from engine.exercises.ch03 import describe, run_array_checks
from engine.formats.config import LlamaConfig, config_from_dict
from engine.model.forward_pass import ForwardBatch, load_model
from engine.model.kv_cache import KVCache
from engine.model.random_model import PRESETS, write_random_model

# ----------------------------------------------------------------------------- the cache append

def kv_append_ref(k_cache, v_cache, k, v, start: int) -> None:
    """Write k, v [T, Hkv, D] at rows start..start+T-1 of k_cache, v_cache [max_context, Hkv, D]."""
    k_cache[start:start + len(k)] = k
    v_cache[start:start + len(v)] = v


def _appended(write: Callable, start_shift: int = 0) -> Callable:
    """Run a cache writer on the (copied) caches and return both caches stacked, [2, max_context, Hkv, D]."""
    def run(k_cache, v_cache, k, v, start):
        write(k_cache, v_cache, k, v, start + start_shift)
        return np.stack([k_cache, v_cache])
    return run


def _mistake(write: Callable, start_shift: int = 0) -> Callable:
    """The answer of a mistaken writer, or NaNs where that mistake cannot even run (it then matches nothing)."""
    def run(k_cache, v_cache, k, v, start):
        if not 0 <= start + start_shift <= len(k_cache) - len(k):
            return np.full((2, *k_cache.shape), np.nan)
        return _appended(write, start_shift)(k_cache, v_cache, k, v, start)
    return run


def check_kv_append(fn: Callable) -> bool:
    """fn(k_cache, v_cache, k, v, start) writes k, v [T, Hkv, D] into the caches [max_context, Hkv, D]
    at rows start .. start + T - 1, in place; every other row stays as it was."""
    rng = np.random.default_rng(0)
    cases = []
    # a prefill (start 0), one decode token, a prompt appended after a reused prefix, the last row
    for ctx, Hkv, D, T, start in ((16, 2, 4, 5, 0), (16, 2, 4, 1, 5), (32, 3, 8, 4, 3), (12, 1, 16, 1, 11)):
        k_cache, v_cache = (rng.standard_normal((ctx, Hkv, D), dtype=np.float32) for _ in range(2))
        k, v = (rng.standard_normal((T, Hkv, D), dtype=np.float32) for _ in range(2))
        want = _appended(kv_append_ref)(k_cache.copy(), v_cache.copy(), k, v, start)
        cases.append(((k_cache, v_cache, k, v, start), want))
    hints = [("the cache did not change: write into k_cache/v_cache in place (k_cache[a:b] = k), "
              "do not rebind the name", _mistake(lambda *a: None)),
             ("an off-by-one: the first new token goes at row `start` (its absolute position)",
              _mistake(kv_append_ref, -1)),
             ("an off-by-one: the first new token goes at row `start`, not start + 1",
              _mistake(kv_append_ref, +1)),
             ("k and v were swapped", _mistake(lambda kc, vc, k, v, s: kv_append_ref(kc, vc, v, k, s)))]
    return run_array_checks("kv_append", _appended(fn), cases, rtol=0, atol=0, hints=hints)


# ----------------------------------------------------------------------------- the decode loop

@functools.cache
def tiny_model(preset: str):
    """A tiny random-weight model on the NumPy backend (fp32 weights), built once."""
    with tempfile.TemporaryDirectory(prefix="ch08_") as d:
        return load_model(write_random_model(d, preset, seed=8, dtype="F32"), backend="numpy")


def greedy_by_recomputation(model, prompt: list[int], n_new: int) -> list[int]:
    """The oracle: every step runs the whole sequence again (no cache) and takes the argmax."""
    ids, out = list(prompt), []
    for _ in range(n_new):
        out.append(int(np.argmax(model.logits(ids)[-1])))
        ids.append(out[-1])
    return out


def greedy_with_cache(model, prompt: list[int], n_new: int, position_shift: int = 0) -> list[int]:
    """The chapter's decode loop: prefill into a contiguous cache, then one token per step at its
    absolute position. `position_shift` moves every decode token (to compute a classic bug's answer)."""
    ctx = model.max_context
    cache = KVCache.contiguous(model.config, 1, ctx)
    batch = ForwardBatch.single(prompt, 0, page_table=[0], page_size=ctx, logits_rows=[len(prompt) - 1])
    logits = model.forward(batch, cache)                                       # [1, V]
    out = []
    for step in range(n_new):
        out.append(int(np.argmax(logits[-1])))
        if step + 1 == n_new:
            break                                      # the last token is returned, never fed
        pos = len(prompt) + step + position_shift
        logits = model.forward(ForwardBatch.single([out[-1]], pos, page_table=[0], page_size=ctx), cache)
    return out


class CountingModel:
    """A model that records the tokens that go through it: ids, positions, and whether a cache came along."""

    def __init__(self, model):
        self._model = model
        self.fed_ids: list[int] = []
        self.fed_positions: list[int] = []
        self.uncached_tokens = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    @property
    def tokens(self) -> int:
        return len(self.fed_ids)

    def forward(self, batch, cache=None):
        self.fed_ids += batch.token_ids.tolist()
        self.fed_positions += batch.positions.tolist()
        self.uncached_tokens += 0 if cache is not None else batch.num_tokens
        return self._model.forward(batch, cache)

    def logits(self, token_ids):
        self.fed_ids += [int(t) for t in token_ids]
        self.fed_positions += list(range(len(token_ids)))
        self.uncached_tokens += len(token_ids)
        return self._model.logits(token_ids)


def check_decode_loop(fn: Callable) -> bool:
    """fn(model, prompt_ids, n_new) -> the n_new greedy tokens (eos ignored), computed with a KV cache:
    the prompt goes through the model once, then exactly one token per step."""
    rng = np.random.default_rng(1)
    title = "decode_loop"
    count = 0
    for preset, P, n in (("tiny", 7, 9), ("tiny-mqa", 1, 6), ("tiny-mha-untied", 12, 5), ("tiny", 30, 1)):
        model = tiny_model(preset)
        prompt = [int(t) for t in rng.integers(0, model.config.vocab_size, P)]
        want = greedy_by_recomputation(model, prompt, n)
        counting = CountingModel(model)
        call = f"{getattr(fn, '__name__', 'fn')}(model={preset}, prompt of {P} tokens, n_new={n})"
        ok, got = call_learner(title, call, fn, counting, list(prompt), n)
        if not ok:
            return False
        try:
            got = [int(t) for t in got]
        except (TypeError, ValueError):
            print(f"[x] {title}: {call} returned {type(got).__name__}, expected a list of {n} token ids")
            return False
        if got != want:
            reason = f"returned {got}, expected {want} (greedy by full recomputation)"
            if len(got) != n:
                reason = f"returned {len(got)} tokens, expected {n}"
            elif n > 1 and got == greedy_with_cache(model, prompt, n, -1):
                reason += (" -- it looks like each decode token went one position too early "
                           "(over the last prompt token's K/V); token i of the output sits at len(prompt) + i")
            elif n > 1 and got == greedy_with_cache(model, prompt, n, +1):
                reason += (" -- it looks like each decode token went one position too late, leaving a row of "
                           "zeros in the cache that attention then reads")
            print(f"[x] {title}: {call} {reason}")
            return False
        wanted_tokens = P + n - 1
        if counting.tokens != wanted_tokens or counting.uncached_tokens:
            if counting.uncached_tokens:
                why = (f"{counting.uncached_tokens} of them without a cache: pass the KVCache to "
                       "model.forward, and do not call model.logits (it recomputes everything)")
            elif counting.tokens == wanted_tokens + 1:
                why = "one forward pass too many: the last new token is returned, never fed (its K/V is never needed)"
            elif counting.tokens > wanted_tokens:
                why = "feed the prompt once, then only the newest token at each step"
            else:
                why = "fewer than the prompt plus one token per step"
            print(f"[x] {title}: {call} gives the right tokens but {counting.tokens} tokens went through "
                  f"the model, expected {P} + {n} - 1 = {wanted_tokens}; {why}")
            return False
        # Right tokens can hide a wrong position (random tiny models are forgiving): check what was fed.
        fed = list(zip(counting.fed_ids, counting.fed_positions))
        expected = list(zip(prompt + want[:-1], range(wanted_tokens)))
        if fed != expected:
            i = next(j for j, (a, b) in enumerate(zip(fed, expected)) if a != b)
            print(f"[x] {title}: {call} gives the right tokens, but fed token #{i} (from 0) was id {fed[i][0]} at "
                  f"position {fed[i][1]}; expected id {expected[i][0]} at position {expected[i][1]} "
                  "(the prompt at 0..P-1, then new token i at its absolute position P + i)")
            return False
        count += 1
    print(f"[OK] {title}: all {count} cases pass (same tokens as full recomputation, P + n - 1 tokens computed)")
    return True


# ----------------------------------------------------------------------------- top-p

def top_p_keep_ref(probs: np.ndarray, top_p: float) -> np.ndarray:
    """bool [V]: the smallest set of most likely tokens whose probability sum reaches top_p, plus every
    token tied with the least likely one kept (engine.ops.sampling.keep_mask with temperature 1, no top-k)."""
    p = np.asarray(probs, dtype=np.float64)
    desc = np.sort(p)[::-1]
    n = int(np.searchsorted(np.cumsum(desc), top_p * p.sum(), side="left"))
    return p >= desc[min(n, p.size - 1)]


def _top_p_cases(rng) -> list:
    """Hand cases (exact binary fractions, ties, unsorted) and random rows away from the boundary."""
    cases = [(np.array([0.5, 0.25, 0.125, 0.125]), 0.7), (np.array([0.125, 0.5, 0.125, 0.25]), 0.8),
             (np.array([0.25, 0.25, 0.25, 0.25]), 0.3), (np.array([0.9, 0.05, 0.05]), 0.5),
             (np.array([0.1, 0.2, 0.3, 0.4]), 1.0)]
    while len(cases) < 15:
        V = int(rng.integers(5, 3000))
        logits = rng.standard_normal(V) * rng.uniform(0.5, 5)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top_p = float(rng.choice([0.5, 0.9, 0.95, rng.uniform(0.05, 0.99)]))
        cum = np.cumsum(np.sort(probs)[::-1])
        if np.min(np.abs(cum - top_p)) > 1e-6:          # no kept-or-not decision rests on rounding
            cases.append((probs, top_p))
    return cases


def _top_p_exclusive(probs, top_p):
    """A classic mistake: keep only the tokens before the one that crosses top_p."""
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(probs.shape, dtype=bool)
    keep[order[np.cumsum(probs[order]) < top_p]] = True
    return keep


def _top_p_cut_ties(probs, top_p):
    """Another: keep the first n sorted tokens, which drops tokens tied with the last one kept."""
    order = np.argsort(-probs, kind="stable")
    n = int(np.searchsorted(np.cumsum(probs[order]), top_p * probs.sum(), side="left"))
    keep = np.zeros(probs.shape, dtype=bool)
    keep[order[:n + 1]] = True
    return keep


def _top_p_ascending(probs, top_p):
    """Another: accumulate from the least likely token up."""
    order = np.argsort(probs, kind="stable")
    n = int(np.searchsorted(np.cumsum(probs[order]), top_p))
    keep = np.zeros(probs.shape, dtype=bool)
    keep[order[:n + 1]] = True
    return keep


def check_top_p_keep(fn: Callable) -> bool:
    """fn(probs [V] summing to 1, top_p in (0, 1]) -> bool [V]: which tokens nucleus sampling keeps."""
    cases = [((probs, top_p), top_p_keep_ref(probs, top_p)) for probs, top_p in _top_p_cases(np.random.default_rng(2))]
    hints = [("the token that crosses top_p was dropped; it is kept (the kept mass must reach top_p)", _top_p_exclusive),
             ("the least likely tokens were kept: sort from the most likely down", _top_p_ascending),
             ("a token tied with the last one kept was dropped: equal probabilities are kept or dropped together "
              "(keep every token with probability >= the last kept one's, not the first n of the sort)", _top_p_cut_ties),
             ("that keeps the tokens whose own probability is >= top_p; top-p is about the cumulative mass",
              lambda p, tp: p >= tp)]
    return run_array_checks("top_p_keep", fn, cases, rtol=0, atol=0, hints=hints)


# ----------------------------------------------------------------------------- the draw

def inverse_cdf_ref(probs: np.ndarray, u: float) -> int:
    """The first index i (in vocabulary order) whose running sum of probs exceeds u * total."""
    cum = np.cumsum(np.asarray(probs, dtype=np.float64))
    return int(min(np.searchsorted(cum, u * cum[-1], side="right"), len(cum) - 1))


def check_inverse_cdf(fn: Callable) -> bool:
    """fn(probs [V] >= 0, not necessarily normalized, u in [0, 1)) -> the sampled index: walk the
    vocabulary in index order and return the first token whose running mass exceeds u * total."""
    rng = np.random.default_rng(3)
    cases = [((np.array([0.5, 0.25, 0.25]), u), i) for u, i in ((0.0, 0), (0.49, 0), (0.74, 1), (0.5, 1), (0.75, 2), (0.99, 2))]
    cases += [((np.array([0.0, 2.0, 0.0, 2.0]), 0.0), 1), ((np.array([0.0, 2.0, 0.0, 2.0]), 0.6), 3),
              ((np.array([3.0]), 0.3), 0)]
    for _ in range(12):
        probs = rng.random(int(rng.integers(2, 500))) ** 4
        probs[rng.random(probs.size) < 0.3] = 0.0                              # tokens cut by top-k/top-p
        probs[int(rng.integers(probs.size))] = 1.0
        u = float(rng.random())
        cases.append(((probs, u), inverse_cdf_ref(probs, u)))
    hints = [("that returns the first index whose running sum *reaches* u x total; it must exceed it "
              "(otherwise a zero-weight token before the pick, or u = 0, goes wrong)",
              lambda p, u: np.searchsorted(np.cumsum(p), u * np.sum(p), side="left")),
             ("that is the most likely token, not a draw", lambda p, u: np.argmax(p))]
    return run_array_checks("inverse_cdf", fn, [(args, np.array(want)) for args, want in cases],
                            rtol=0, atol=0, hints=hints)


# ----------------------------------------------------------------------------- KV memory

def preset_config(name: str) -> LlamaConfig:
    return config_from_dict(PRESETS[name])


def kv_cache_bytes_ref(config: LlamaConfig, num_seqs: int, max_context: int, bytes_per_value: int) -> int:
    """A contiguous cache preallocates every sequence's whole context: K and V, every layer, every KV head."""
    return num_seqs * max_context * 2 * config.num_hidden_layers * config.num_key_value_heads \
        * config.head_dim * bytes_per_value


def check_kv_cache_bytes(fn: Callable) -> bool:
    """fn(config, num_seqs, max_context, bytes_per_value) -> bytes of a contiguous KV cache holding
    num_seqs sequences of max_context tokens (what KVCache.contiguous allocates)."""
    checked = []
    for name, seqs, ctx, bpv in (("llama-3.2-1b", 1, 131072, 2), ("llama-3.2-1b", 64, 4096, 2),
                                 ("smollm2-135m", 1, 8192, 2), ("smollm2-135m", 1, 4096, 4),
                                 ("tiny", 3, 256, 4), ("tiny-mqa", 2, 100, 4), ("tiny-mha-untied", 5, 128, 4),
                                 ("llama-3.2-1b", 256, 2056, 1)):
        cfg = preset_config(name)
        # the tiny fp32 caches are really allocated: the answer is what the engine allocates
        want = KVCache.contiguous(cfg, seqs, ctx, "numpy").nbytes if name.startswith("tiny") \
            else kv_cache_bytes_ref(cfg, seqs, ctx, bpv)
        checked.append(((cfg, seqs, ctx, bpv), want))

    hints = [("K and V are two tensors: the factor 2 is missing", lambda cfg, *rest: _want(cfg, *rest) // 2),
             ("that counts the query heads; the cache only holds the KV heads",
              lambda cfg, *rest: _want(cfg, *rest) // cfg.num_key_value_heads * cfg.num_attention_heads),
             ("that is one layer; every layer has its own K and V",
              lambda cfg, *rest: _want(cfg, *rest) // cfg.num_hidden_layers)]
    return check_cases("kv_cache_bytes", fn, checked, hints=hints,
                       label=lambda f, args: f"{getattr(f, '__name__', 'fn')}{describe(args)} "
                                             f"with {config_label(args[0])}")


def _want(cfg: LlamaConfig, seqs: int, ctx: int, bpv: int) -> int:
    return kv_cache_bytes_ref(cfg, seqs, ctx, bpv)


def config_label(cfg: LlamaConfig) -> str:
    return (f"L={cfg.num_hidden_layers}, heads={cfg.num_attention_heads}, kv_heads={cfg.num_key_value_heads}, "
            f"head_dim={cfg.head_dim}")
