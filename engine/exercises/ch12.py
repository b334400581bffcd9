"""Chapter 12 exercises: the decode speed limit, what fits in a KV pool, reading a serving log, and the
incremental detokenizer that every stream of the chat and the server goes through."""
from __future__ import annotations

import math
import tempfile
from collections.abc import Callable

import numpy as np

from engine.exercises import check_cases
from engine.exercises.ch08 import config_label, preset_config
from engine.formats.config import LlamaConfig
from engine.model.random_model import write_random_model
from engine.runtime.kv_allocator import PageAllocator, SlotAllocator
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.step_log import StepRecord, summarize

GIB = 2**30


def _call(fn: Callable, args: tuple) -> str:
    def show(a):
        if isinstance(a, LlamaConfig):
            return config_label(a)
        if isinstance(a, list) and len(a) > 8:
            return f"[{len(a)} lengths: {', '.join(map(str, a[:4]))}, ...]"
        return repr(a)
    parts = [show(a) for a in args]
    return f"{getattr(fn, '__name__', 'fn')}({', '.join(parts)})"


def _close(got, want) -> bool:
    return math.isclose(float(got), float(want), rel_tol=1e-6)


# ----------------------------------------------------------------------------- the bandwidth floor

def decode_floor_ref(config: LlamaConfig, batch: int, context_len: int, bandwidth_gbps: float,
                     bytes_per_value: int = 2) -> float:
    """Best possible decode tokens/s: each step reads every weight once plus each sequence's K/V, and
    produces one token per sequence."""
    weights = config.num_parameters() * bytes_per_value
    kv = batch * context_len * config.kv_bytes_per_token(bytes_per_value)
    return batch * bandwidth_gbps * 1e9 / (weights + kv)


def check_decode_floor(fn: Callable) -> bool:
    """fn(config, batch, context_len, bandwidth_gbps, bytes_per_value) -> the decode tokens/s that memory
    bandwidth allows: a step reads all weights once and the K/V of context_len tokens per sequence."""
    llama, smol = preset_config("llama-3.2-1b"), preset_config("smollm2-135m")
    setups = [(llama, 1, 256, 4200.0, 2), (llama, 64, 1024, 4200.0, 2), (llama, 256, 600, 4200.0, 2),
              (smol, 1, 128, 18.0, 4), (smol, 16, 4096, 3350.0, 2), (llama, 1, 0, 1000.0, 1)]
    cases = [(args, decode_floor_ref(*args)) for args in setups]
    hints = [("the K/V reads are missing (they dominate at large batch x context)",
              lambda c, b, n, bw, bpv: b * bw * 1e9 / (c.num_parameters() * bpv)),
             ("that is steps/s; a step produces one token per sequence: multiply by the batch",
              lambda c, b, n, bw, bpv: decode_floor_ref(c, b, n, bw, bpv) / b),
             ("the K/V was counted once per step; every sequence reads its own",
              lambda c, b, n, bw, bpv: b * bw * 1e9 / (c.num_parameters() * bpv + n * c.kv_bytes_per_token(bpv)))]
    return check_cases("decode_floor", fn, cases, same=_close, hints=hints, label=_call)


# ----------------------------------------------------------------------------- what fits in a pool

def contiguous_slots_ref(config: LlamaConfig, pool_bytes: int, max_context: int, bytes_per_value: int = 2) -> int:
    """Sequences a contiguous pool holds at once: each reserves max_context tokens up front."""
    return pool_bytes // (max_context * config.kv_bytes_per_token(bytes_per_value))


def check_contiguous_slots(fn: Callable) -> bool:
    """fn(config, pool_bytes, max_context, bytes_per_value) -> how many max_context-token slots fit."""
    llama, smol = preset_config("llama-3.2-1b"), preset_config("smollm2-135m")
    cases = [(llama, 8 * GIB, 2056, 2), (llama, 8 * GIB, 4096, 2), (llama, 1 * GIB, 131072, 2),
             (smol, 1 * GIB, 4096, 4), (smol, 512 * 2**20, 8192, 2), (llama, 70 * GIB, 8192, 1)]
    checked = []
    for cfg, pool, ctx, bpv in cases:
        slots = contiguous_slots_ref(cfg, pool, ctx, bpv)
        SlotAllocator(max(slots, 1), ctx)                          # the engine's allocator takes it
        checked.append(((cfg, pool, ctx, bpv), slots))
    hints = [("that rounds up; a slot that does not fit entirely is no slot: round down",
              lambda c, p, n, b: -(-p // (n * c.kv_bytes_per_token(b)))),
             ("K and V are two tensors: the factor 2 is missing",
              lambda c, p, n, b: p // (n * c.kv_bytes_per_token(b) // 2))]
    return check_cases("contiguous_slots", fn, checked, same=lambda got, want: int(got) == want, hints=hints,
                       label=_call)


def paged_fit_ref(config: LlamaConfig, pool_bytes: int, seq_lens: list[int], page_size: int = 16,
                  bytes_per_value: int = 2) -> int:
    """How many of the sequences, admitted in order, a paged pool holds at once (each takes
    ceil(len / page_size) pages), found by asking the engine's PageAllocator."""
    num_pages = pool_bytes // (page_size * config.kv_bytes_per_token(bytes_per_value))
    if num_pages < 1:
        return 0
    pool = PageAllocator(int(num_pages), page_size)
    for i, n in enumerate(seq_lens):
        if not pool.can_reserve(i, n):
            return i
        pool.reserve(i, n)
    return len(seq_lens)


def check_paged_fit(fn: Callable) -> bool:
    """fn(config, pool_bytes, seq_lens, page_size, bytes_per_value) -> how many of the sequences, taken in
    order, fit in a paged pool at once: the pool has pool_bytes // (page_size * bytes per token) pages
    and a sequence of n tokens takes ceil(n / page_size) of them."""
    rng = np.random.default_rng(4)
    llama, smol = preset_config("llama-3.2-1b"), preset_config("smollm2-135m")
    lens = [int(n) for n in rng.integers(100, 1025, 400)]
    cases = [(llama, 8 * GIB, lens, 16, 2), (llama, 1 * GIB, lens, 16, 2), (llama, 1 * GIB, lens, 256, 2),
             (smol, 64 * 2**20, [17, 16, 1, 33, 500, 2, 2, 2], 16, 4), (smol, 23040 * 16, [16, 1], 16, 2),
             (smol, 23040 * 16, [17], 16, 2), (llama, 8 * GIB, [2056] * 300, 16, 2)]
    checked = [(args, paged_fit_ref(*args)) for args in cases]

    def by_tokens(c, p, lens, ps, b):
        return int(np.searchsorted(np.cumsum(lens), p // c.kv_bytes_per_token(b), side="right"))
    hints = [("the sequences were counted in tokens; each takes whole pages (round its length up)", by_tokens)]
    return check_cases("paged_fit", fn, checked, same=lambda got, want: int(got) == want, hints=hints,
                       label=_call)


# ----------------------------------------------------------------------------- a serving log

def step_log_summary_ref(step_log: list[StepRecord]) -> tuple[int, int, float]:
    """(prefill steps, decode steps, mean rows of the decode steps) of LLM.last_step_log."""
    totals = summarize(step_log)
    return totals["prefill_steps"], totals["decode_steps"], totals["mean_decode_rows"]


def serving_logs() -> list[list[StepRecord]]:
    """Real step logs of engine.LLM on a tiny random model: static and continuous, roomy and tight pools."""
    from engine.runtime.llm import LLM
    rng = np.random.default_rng(5)
    logs = []
    with tempfile.TemporaryDirectory(prefix="ch12_") as d:
        model_dir = write_random_model(f"{d}/tiny", "tiny", seed=12, dtype="F32")
        for batching, kv, mib, max_seqs in (("continuous", "paged", None, 4), ("static", "contiguous", None, 4),
                                            ("continuous", "paged", 0.05, 8)):
            llm = LLM(model_dir, "numpy", batching=batching, kv_cache=kv, kv_cache_mib=mib,
                      max_context=96, max_seqs=max_seqs, chunked_prefill=False)   # kinds: prefill | decode
            prompts = [[int(t) for t in rng.integers(3, 300, int(rng.integers(2, 20)))] for _ in range(7)]
            params = [SamplingParams(max_new_tokens=int(rng.integers(1, 30)), ignore_eos=True) for _ in prompts]
            llm.generate(prompts, params)
            logs.append(llm.last_step_log)
    return logs


def check_step_log_summary(fn: Callable) -> bool:
    """fn(step_log) -> (prefill_steps, decode_steps, mean_decode_rows): how many steps of each kind
    LLM.generate ran, and how many sequences a decode step served on average (0.0 without decode steps)."""
    cases = [((log,), step_log_summary_ref(log)) for log in serving_logs()] + [(([],), (0, 0, 0.0))]

    def same(got, want):
        return len(got) == 3 and [int(g) for g in got[:2]] == list(want[:2]) and _close(got[2], want[2])

    def mean_over_all_steps(log):
        rows = [s["rows"] for s in log]
        return step_log_summary_ref(log)[:2] + (float(np.mean(rows)) if rows else 0.0,)

    hints = [("the mean counts the rows of every step; only decode steps count", mean_over_all_steps)]
    return check_cases("step_log_summary", fn, cases, same=same, hints=hints,
                label=lambda f, args: f"{getattr(f, '__name__', 'fn')}(<step log of {len(args[0])} steps>)")


# ----------------------------------------------------------------------------- the incremental detokenizer

REPLACEMENT = "\ufffd"


def _detok_streams(tok) -> list[tuple[str, list[int]]]:
    """(what it is, token ids) streams of the default model's tokenizer: accents, CJK and emoji split
    across byte-level tokens, special tokens, and streams that end inside a character."""
    def ids(text):
        return tok.encode(text, add_special_tokens=False)
    star = ids("🌟")
    streams = [("ASCII", ids("The capital of France is Paris.")),
               ("accents", ids("Un café, s'il vous plaît: déjà vu à Noël.")),
               ("Japanese", ids("「ありがとう」は日本語で感謝を表します。")),
               ("emoji", ids("Stars: 🌟🌟 and a rocket 🚀, then 👍🏽!")),
               ("ends inside an emoji", ids("Look: 🌟") + star[:-1]),
               ("ends inside a character after text", ids("naïve 🚀")[:-1])]
    im_end = tok.token_to_id("<|im_end|>")
    if im_end is not None:
        streams.append(("a special token in the stream", ids("Hi 🌟") + [im_end] + ids(" bye")))
    lone = [i for i, b in tok._token_bytes.items() if b == b"\x80"]
    if lone:   # a continuation byte with no lead: U+FFFD at once, as decode() shows it
        streams.append(("a stray continuation byte", ids("ok ") + lone[:1] + ids(" fine")))
    return [(name, s) for name, s in streams if s]


def _stream_of(cls, tok, ids, skip: bool):
    """(pieces pushed, flushed text) of one detokenizer over ids; raises what the learner's raises."""
    detok = cls(tok, skip)
    pieces = [detok.push(int(t)) for t in ids]
    return pieces, detok.flush()


def _diagnose_stream(tok, ids, skip: bool, pieces, tail, want_pieces) -> str | None:
    """Why a stream differs from the engine's (the first push where it does), or None when it does not."""
    for k, p in enumerate([*pieces, tail]):
        if not isinstance(p, str):
            return f"push {k} returned {type(p).__name__}, expected str (the new text, '' when none)"
    full = tok.decode(ids, skip_special_tokens=skip)
    so_far = want_so_far = ""
    for k, (p, w) in enumerate(zip(pieces, want_pieces)):
        before = so_far
        so_far, want_so_far = so_far + p, want_so_far + w
        if so_far == want_so_far:
            continue
        where = f"push {k} (token {ids[k]}, bytes {tok.token_bytes([ids[k]])!r})"
        if REPLACEMENT in p and REPLACEMENT not in w:
            return (f"{where} emitted {p!r}: part of a multi-byte character -- its bytes are split across "
                    f"tokens; hold the incomplete UTF-8 sequence back until the rest arrives (the engine's "
                    f"stream so far: {want_so_far!r})")
        again = next((before[j:] for j in range(len(before)) if p.startswith(before[j:])), "")  # already out
        if again and not full.startswith(so_far) and full.startswith(before):
            return (f"{where} returned {p!r}, which starts with {again!r}: text the stream had already "
                    f"emitted -- return only the text that is new since the last push (your stream so far: "
                    f"{so_far!r})")
        if not full.startswith(so_far):
            return f"after {where} your stream is {so_far!r}, but these tokens' text starts {full[:len(so_far) + 8]!r}"
        return (f"after {where} your stream is {so_far!r}, the engine's {want_so_far!r} -- text whose bytes "
                f"are complete goes out at once; hold back only an unfinished UTF-8 sequence at the end")
    if so_far + tail != full:
        if full.startswith(so_far + tail):
            return (f"the pushes and flush() gave {so_far + tail!r}, but the tokens decode to {full!r} -- the "
                    f"final flush lost the held-back text {full[len(so_far + tail):]!r}: at the end of the stream "
                    f"flush() emits what is held back (an unfinished sequence as U+FFFD, as decode() shows it)")
        if (so_far + tail).startswith(full) or tail and tail in so_far:
            return (f"the pushes and flush() gave {so_far + tail!r}, the tokens decode to {full!r} -- flush() "
                    f"re-emitted text: it returns only what is still held back")
        return f"the pushes and flush() gave {so_far + tail!r}, the tokens decode to {full!r}"
    return None


def tok_skip(name: str) -> bool:
    return name == "a special token in the stream"


def check_detokenizer(cls) -> bool:
    """cls(tokenizer, skip_special_tokens) with .push(token_id) -> new text and .flush() -> the rest,
    like engine.text.tokenizer.IncrementalDetokenizer: on streams of the default model's tokenizer, each
    push returns exactly the text that became complete with that token, and the pushes plus flush()
    equal tok.decode(ids)."""
    import engine
    from engine.text.tokenizer import IncrementalDetokenizer
    title = "detokenizer"
    tok = engine.load_tokenizer(engine.ensure_default_model())
    count = 0
    for name, ids in _detok_streams(tok):
        skip = tok_skip(name)
        want_pieces, _ = _stream_of(IncrementalDetokenizer, tok, ids, skip)
        try:
            pieces, tail = _stream_of(cls, tok, ids, skip)
        except NotImplementedError:
            print(f"[ ] {title}: not attempted yet (a method still raises NotImplementedError)")
            return False
        except Exception as e:  # the learner's bug, shown rather than raised
            print(f"[x] {title} ({name}): raised {type(e).__name__}: {e}")
            return False
        why = _diagnose_stream(tok, ids, skip, list(pieces), tail, want_pieces)
        if why:
            print(f"[x] {title} ({name}, {len(ids)} tokens{', skip_special_tokens=True' if skip else ''}): {why}")
            return False
        count += 1
    print(f"[OK] {title}: all {count} streams match the engine's, push by push (accents, CJK, emoji, a "
          f"stream ending inside a character, special tokens)")
    return True


class use_detokenizer:
    """`with use_detokenizer(llm.tokenizer, MyDetokenizer):` every stream of that tokenizer (handles of
    engine.LLM, the chat, the server's SSE chunks, stop strings) detokenizes through your class."""

    def __init__(self, tokenizer, cls):
        self.tokenizer, self.cls = tokenizer, cls

    def __enter__(self):
        tok, cls = self.tokenizer, self.cls
        tok.detokenizer = lambda skip_special_tokens=False: cls(tok, skip_special_tokens)
        return self

    def __exit__(self, *exc):
        del self.tokenizer.detokenizer      # the class's own method again
        return False


def check_detokenizer_in_chat(cls, question: str = "Write the word café and an emoji.",
                              max_new_tokens: int = 12) -> bool:
    """The default model's chat streams its answer through your detokenizer (python -m engine.chat's
    Chat on a local engine.LLM): the same pieces as the engine's own, and the same reply text."""
    import io

    import engine
    from engine.chat.local import Chat
    title = "detokenizer in the chat"
    model_dir = engine.ensure_default_model()
    llm = engine.LLM(model_dir, backend="numpy", max_seqs=1, max_context=256)
    params = SamplingParams(max_new_tokens=max_new_tokens)

    def answer():
        chat, out = Chat(model_dir, "numpy", params, None, 256, llm=llm), _Pieces()
        chat.answer(question, out=out, notices=io.StringIO())
        return out.pieces

    want = answer()
    try:
        with use_detokenizer(llm.tokenizer, cls):
            got = answer()
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (a method still raises NotImplementedError)")
        return False
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] {title}: the chat with your detokenizer raised {type(e).__name__}: {e}")
        return False
    if got != want:
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        print(f"[x] {title}: piece {k} of the streamed reply differs: yours {got[k:k + 3]!r}, the engine's "
              f"{want[k:k + 3]!r}")
        return False
    print(f"    {question!r} -> streamed as {got[:-1]!r}")
    print(f"[OK] {title}: the chat streamed {len(got) - 1} pieces through your detokenizer, the engine's "
          f"pieces exactly ({''.join(got).strip()!r})")
    return True


class _Pieces:
    """A stdout that keeps every write separately (each write of the chat is one streamed piece)."""

    def __init__(self):
        self.pieces: list[str] = []

    def write(self, text: str) -> None:
        self.pieces.append(text)

    def flush(self) -> None:
        pass
