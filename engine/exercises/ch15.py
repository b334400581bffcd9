"""Chapter 15 exercises: the page-key chain, the longest cached prefix (both plugged into the engine's
scheduler and run inside engine.LLM), and a reference-counted pool of pages.

Also the chapter's teaching device: `PrefixDevice` runs the scheduler's batches without a model. Each
cache entry holds a token and a *fingerprint* of the whole prefix up to it, as a real K/V entry
depends on every token before it, and every read checks the fingerprints: a request that is handed
a page of another prefix (the same tokens at another position, or after other tokens) is caught at
the first position it reads wrongly.
"""
from __future__ import annotations

import random
import zlib
from collections import deque
from collections.abc import Callable, Hashable

import numpy as np

from engine.exercises import call_learner
from engine.runtime.kv_allocator import KVAllocator, PageAllocator
from engine.runtime.prefix_cache import cached_prefix
from engine.runtime.prefix_cache import page_key as engine_page_key
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler

FAKE_VOCAB = 50

# ----------------------------------------------------------------------------- the teaching device


def fingerprint(previous: int, token: int) -> int:
    """What a fake K/V entry holds beside its token: a checksum of the prefix up to and including it."""
    return zlib.crc32(np.asarray([previous, token], dtype=np.int64).tobytes())


def fake_next_token(context: list[int]) -> int:
    """The fake model: the next token is a function of the whole context (as a real model's is)."""
    return zlib.crc32(np.asarray(context, dtype=np.int64).tobytes()) % (FAKE_VOCAB - 1) + 1


class WrongKV(AssertionError):
    """A row read a cache entry that does not belong to its own prefix."""

    def __init__(self, request_id: int, position: int, context: list[int], page: int):
        self.request_id, self.position, self.context, self.page = request_id, position, context, page
        super().__init__(f"request {request_id} read K/V of another prefix at position {position} (page {page})")


class PrefixDevice:
    """Runs batches as the model runner would, without a model: page copies first (copy-on-write),
    then each new token is written with its prefix's fingerprint into its slot, then every sampling
    row reads its whole context back through its page table and checks each entry's fingerprint.
    `computed` counts the tokens fed (what a real model would have computed)."""

    def __init__(self, verify: bool = True):
        self.verify = verify        # False: write only, sample from the last token (fast simulations)
        self.cache: dict[int, tuple[int, int]] = {}
        self.computed = 0
        self.copies = 0

    def run(self, batch, known: dict[int, list[int]] | None = None) -> list[int]:
        """known: request id -> its tokens so far (prompt + generated); with it, a cached entry must
        also hold the request's own token at its position."""
        size = batch.page_size
        for src, dst in batch.page_copies:
            self.copies += 1
            for offset in range(size):
                self.cache[dst * size + offset] = self.cache.get(src * size + offset, (-1, -1))
        rows = np.repeat(np.arange(len(batch.rows)), batch.lengths).tolist()
        for slot, token, pos, r in zip(batch.slot_mapping.tolist(), batch.token_ids.tolist(),
                                       batch.positions.tolist(), rows, strict=True):
            table = batch.rows[r].page_table
            before = self.cache.get(table[(pos - 1) // size] * size + (pos - 1) % size, (-1, -1))[1] if pos else 0
            self.cache[slot] = (token, fingerprint(before, token))
        self.computed += batch.num_tokens
        sampled = []
        for row in batch.rows:
            if not row.samples:
                continue
            if not self.verify:
                sampled.append(fake_next_token([row.token_ids[-1], row.context_len]))
                continue
            context: list[int] = []
            expected = 0
            for p in range(row.context_len):
                page = row.page_table[p // size]
                token, fp = self.cache.get(page * size + p % size, (-1, -1))
                expected = fingerprint(expected, token)
                own = known.get(row.request_id) if known else None
                if fp != expected or (own is not None and p < len(own) and own[p] != token):
                    raise WrongKV(row.request_id, p, context, page)
                context.append(token)
            sampled.append(fake_next_token(context))
        return sampled


def serve_fake(sched: Scheduler, requests, per_step: int | None = None, device: PrefixDevice | None = None):
    """Serve (prompt, params) requests with `sched` on a PrefixDevice: `per_step` new arrivals before
    each step (None: each request arrives after the previous one has finished). Returns
    (token ids per request in order, the device)."""
    device = device or PrefixDevice()
    pending = list(requests)
    ids: list[int] = []
    results: dict[int, list[int]] = {}
    known: dict[int, list[int]] = {}        # request id -> prompt + generated so far

    def submit(prompt, params):
        rid = sched.submit(prompt, params)
        ids.append(rid)
        known[rid] = list(prompt)
    while pending or sched.has_unfinished():
        if per_step is None:
            if not sched.has_unfinished() and pending:
                submit(*pending.pop(0))
        else:
            for _ in range(min(per_step, len(pending))):
                submit(*pending.pop(0))
        for result in sched.pop_finished():
            results[result.request_id] = result.token_ids
        batch = sched.schedule()
        if batch is None:
            continue
        out = sched.complete(batch.batch_id, device.run(batch, known))
        for rid, token in out.sampled:
            known[rid].append(token)
        for result in out.finished:
            results[result.request_id] = result.token_ids
    return [results[rid] for rid in ids], device


def shared_prompt_workload(n_requests: int = 200, n_systems: int = 6, system_len: int = 96,
                           question_len: tuple[int, int] = (8, 40), new_tokens: int = 16, seed: int = 0):
    """A room of users: each request is one of a few system prompts (some far more popular than
    others: weights 1, 1/2, 1/3, ...) followed by its own question, then `new_tokens` to generate."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, FAKE_VOCAB) for _ in range(system_len)] for _ in range(n_systems)]
    weights = [1 / (i + 1) for i in range(n_systems)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return [(list(rng.choices(systems, weights)[0]) + [rng.randrange(1, FAKE_VOCAB)
                                                        for _ in range(rng.randrange(*question_len))], params)
            for _ in range(n_requests)]


class HeadFirstFreeing(PageAllocator):
    """The engine's allocator, but free() puts a table's pages on the free queue in table order (the
    first page first): the beginning of a prefix is then evicted before its end (for comparison)."""

    def free(self, seq_id: int) -> None:
        table = self._tables[seq_id]
        self._set_table(seq_id, None)
        for page in table:
            self._release(page)


def hit_rate(num_pages: int, requests, page_size: int = 16, max_seqs: int = 8, per_step: int = 2,
             allocator_cls: type[PageAllocator] = PageAllocator, prefix_caching: bool = True) -> dict:
    """Serve `requests` on a PrefixDevice with a pool of num_pages pages: the share of the looked-up
    prompt tokens that were found in the cache, and the tokens computed."""
    sched = Scheduler(allocator_cls(num_pages, page_size), max_seqs, 512, 1024, prefix_caching=prefix_caching,
                      admission="on_demand", chunked_prefill=True)
    _, device = serve_fake(sched, requests, per_step=per_step, device=PrefixDevice(verify=False))
    return {"hit_rate": sched.hit_tokens / max(sched.lookup_tokens, 1), "computed": device.computed,
            "preemptions": sched.num_preemptions}


# ----------------------------------------------------------------------------- exercise 1: page_key


def _no_parent(parent, tokens):
    return tokens


def check_page_key(fn: Callable[[Hashable, tuple], Hashable]) -> bool:
    """fn(parent, tokens) -> a key that names a full page: equal for equal arguments, different as soon
    as the parent or any token (or their order) differs, and usable as a dict key."""
    title = "page_key"
    root, tokens = ("root",), (5, 7, 7, 2)
    calls = [(root, tokens), (root, tokens), (0, tokens), (1, tokens), (root, (2, 7, 7, 5)),
             (root, (5, 7, 7, 3)), (0, (1, 2)), (0, (1, 2 + 2**61 - 1)), (3, (4,)), (4, (3,))]
    keys = []
    for parent, toks in calls:
        ok, key = call_learner(title, f"page_key({parent!r}, {toks!r})", fn, parent, toks)
        if not ok:
            return False
        try:
            hash(key)
        except TypeError:
            print(f"[x] {title}: page_key({parent!r}, {toks!r}) returned {key!r}, which cannot be a dict key "
                  f"(unhashable {type(key).__name__}): build a tuple")
            return False
        keys.append(key)

    def differ(i, j, why):
        if keys[i] == keys[j]:
            print(f"[x] {title}: page_key{calls[i]!r} and page_key{calls[j]!r} are equal ({keys[i]!r}) -- {why}")
            return False
        return True
    if keys[0] != keys[1]:
        print(f"[x] {title}: two calls with the same parent and tokens gave different keys ({keys[0]!r}, "
              f"{keys[1]!r}): nobody could ever find a page again")
        return False
    checks = [(2, 3, "it looks like the page was hashed without its parent: the same tokens after another "
                     "prefix (or at another position) would hit a page whose K/V were computed for other "
                     "tokens before them"),
              (0, 2, "the root and a parent page are mixed up: the first page must be named by the root"),
              (0, 4, "the key forgets the order of the tokens (a sum, a set or sorted tokens?)"),
              (0, 5, "the key does not depend on every token of the page"),
              (6, 7, "two different pages got the same key: Python's hash() (or any 64-bit hash) collides, "
                     "here on token ids 2**61 - 1 apart; keep the tokens themselves in the key, and a hit "
                     "compares them"),
              (8, 9, "parent and tokens can be swapped without changing the key: keep them apart, (parent, tokens)")]
    for i, j, why in checks:
        if not differ(i, j, why):
            return False
    print(f"[OK] {title}: equal for equal pages, different after another parent, another token or another order, "
          f"no collision")
    return True


# ----------------------------------------------------------------------------- exercise 2: the lookup


class _SpyAllocator:
    """The engine's allocator, seen through what a lookup needs (page_size, lookup, serial), with
    every lookup recorded."""

    def __init__(self, allocator: KVAllocator):
        self._allocator = allocator
        self.page_size = allocator.page_size
        self.looked_up: list[tuple[Hashable, int | None]] = []

    def lookup(self, key):
        page = self._allocator.lookup(key)
        self.looked_up.append((key, page))
        return page

    def serial(self, page):
        return self._allocator.serial(page)

    def __getattr__(self, name):
        return getattr(self._allocator, name)


def _cache_prompts(pool: PageAllocator, prompts, root, free: bool = True) -> None:
    """Register the full pages of each prompt as the scheduler does (one table per prompt)."""
    size = pool.page_size
    for seq, prompt in enumerate(prompts, start=1000):
        full = len(prompt) // size
        if not full:
            continue
        pool.reserve(seq, full * size)
        parent = root
        for i, page in enumerate(pool.page_table(seq)):
            holder = pool.register(page, engine_page_key(parent, tuple(prompt[i * size:(i + 1) * size])))
            parent = pool.serial(holder)
        if free:
            pool.free(seq)
    pool.commit()


def _lookup_cases():
    """(what the case is, the pool, the root, the tokens to look up)."""
    root = ("root",)
    A, B, C, D, X = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [20, 21, 22, 23]
    cases = []

    def case(text, prompts, tokens, page_size=4, num_pages=24, free=True):
        pool = PageAllocator(num_pages, page_size)
        _cache_prompts(pool, prompts, root, free)
        cases.append((text, pool, root, tokens))
    case("an empty cache", [], A + B + [1])
    case("a prompt whose three pages and more are cached", [A + B + C + D], A + B + C + [30, 31])
    case("a page-aligned prompt (exactly two full pages, both cached)", [A + B + C], A + B)
    case("a prompt that leaves the cached chain after its first page", [A + B + C], A + X + C + [1])
    case("A X C after a cached A C: page 2 must not match (it follows X here)", [A + C], A + X + C + [7])
    case("A B after cached A X and B C: page 1 (B) is cached only at position 0", [A + X, B + C], A + B + [2])
    case("a cached page held by a running request", [A + B], A + B + C, free=False)
    case("the same tokens in a pool of 1-token pages", [[4, 4, 4, 9]], [4, 4, 4, 4, 9], page_size=1)
    case("a prompt shorter than a page", [A + B], [1, 2, 3])
    # a prompt whose middle page was evicted: its last page is still registered, under the evicted parent
    pool = PageAllocator(6, 4)
    _cache_prompts(pool, [A + B + C], root)           # pages 0, 1, 2 hold A, B, C; all three free, cached
    pool.share(7, [2])                                # someone reads C, so it is not on the free queue
    pool.reserve(8, 16)                               # pages 3, 4, 5 and the head of the queue: B (page 1)
    pool.free(8)
    pool.free(7)
    pool.commit()
    cases.append(("A B C after its page B was evicted (C is still cached)", pool, root, A + B + C + [5]))
    return cases


def _without_parent(allocator, tokens, root, key):
    size, pages = allocator.page_size, []
    for start in range(0, len(tokens) - size + 1, size):
        page = allocator.lookup(key(root, tuple(tokens[start:start + size])))
        if page is None:
            break
        pages.append(page)
    return pages


def _past_a_miss(allocator, tokens, root, key):
    size, pages, parent = allocator.page_size, [], root
    for start in range(0, len(tokens) - size + 1, size):
        page = allocator.lookup(key(parent, tuple(tokens[start:start + size])))
        if page is not None:
            pages.append(page)
            parent = allocator.serial(page)
    return pages


def _one_short(allocator, tokens, root, key):
    return cached_prefix(allocator, tokens[:-1], root, key)


def _parent_by_key(allocator, tokens, root, key):
    size, pages, parent = allocator.page_size, [], root
    for start in range(0, len(tokens) - size + 1, size):
        k = key(parent, tuple(tokens[start:start + size]))
        page = allocator.lookup(k)
        if page is None:
            break
        pages.append(page)
        parent = k
    return pages


LOOKUP_MISTAKES = [
    ("the pages were looked up without their parent (key(root, tokens) for every page): a page matched "
     "the same tokens at another position, whose K/V were computed after other tokens", _without_parent),
    ("the walk did not stop at the first miss: a later page matched a page that follows other tokens "
     "(the parent it names is not this prompt's page before it)", _past_a_miss),
    ("it stopped one page short: a prompt of exactly k full pages has k cacheable pages "
     "(range(0, len(tokens) - page_size + 1, page_size))", _one_short),
    ("a page's parent was named by the previous key; the engine names it by allocator.serial(previous page), "
     "the number of its registration", _parent_by_key),
]


def _answers(fn, cases) -> list:
    out: list[list[int] | None] = []
    for _, pool, root, tokens in cases:
        try:
            out.append([int(p) for p in fn(pool, list(tokens), root, engine_page_key)])
        except Exception:  # the learner's function failing on another case: no answer there
            out.append(None)
    return out


def _name_lookup_mistake(fn, cases, pool, tokens, root, got, want) -> str | None:
    """The known mistake that gives the learner's answer here, preferring one that agrees with the
    learner on every case (several mistakes can give the same wrong answer on one case)."""
    here = [(hint, mistake) for hint, mistake in LOOKUP_MISTAKES
            if mistake(pool, tokens, root, engine_page_key) == got != want]
    if not here:
        return None
    yours = _answers(fn, cases)
    for hint, mistake in here:
        if _answers(mistake, cases) == yours:
            return hint
    return here[0][0]


def check_longest_cached_prefix(fn: Callable) -> bool:
    """fn(allocator, tokens, root, page_key) -> the registered pages holding the longest run of full
    pages of `tokens` from position 0 (engine.runtime.prefix_cache.cached_prefix's contract)."""
    title = "longest_cached_prefix"
    cases = _lookup_cases()
    for text, pool, root, tokens in cases:
        spy = _SpyAllocator(pool)
        call = f"longest_cached_prefix(allocator, {tokens!r}, root, page_key) on {text}"
        ok, got = call_learner(title, call, fn, spy, list(tokens), root, engine_page_key)
        if not ok:
            return False
        want = cached_prefix(pool, tokens, root)
        size = pool.page_size
        partial = [key for key, _ in spy.looked_up if isinstance(key, tuple) and len(key) == 2
                   and isinstance(key[1], tuple) and len(key[1]) != size]
        if partial:
            print(f"[x] {title}: {call}: it looked up a partial page, {partial[0][1]!r} ({len(partial[0][1])} of "
                  f"{size} tokens): only full pages are ever named (a partial page is still being written)")
            return False
        misses = [i for i, (_, page) in enumerate(spy.looked_up) if page is None]
        if misses and misses[0] < len(spy.looked_up) - 1 and list(got or []) == want:
            print(f"[x] {title}: {call}: the right pages, but it kept looking after the first miss "
                  f"({len(spy.looked_up)} lookups, the first miss was lookup {misses[0] + 1}): nothing after a "
                  f"missing page can be reused, whatever a later key finds")
            return False
        try:
            got = [int(p) for p in got]
        except (TypeError, ValueError):
            print(f"[x] {title}: {call} returned {got!r}: return a list of page numbers")
            return False
        if got != want:
            reason = f"returned {got}, expected {want}"
            hint = _name_lookup_mistake(fn, cases, pool, tokens, root, got, want)
            print(f"[x] {title}: {call} {reason}" + (f" -- it looks like {hint}" if hint else ""))
            return False
    print(f"[OK] {title}: all {len(cases)} cases find the engine's pages, full pages only, stopping at the first miss")
    return True


# ----------------------------------------------------------------------------- yours inside the engine


def _engine_workload():
    """Prompts that share a system prompt, a repeat, a page-aligned prompt (fully cached: its last page
    is copied), the same pages in the other order, and a prompt that leaves a cached chain midway."""
    rng = np.random.default_rng(15)
    system = rng.integers(3, 390, size=37).tolist()
    a, b = rng.integers(3, 390, size=8).tolist(), rng.integers(3, 390, size=8).tolist()
    prompts = [system + rng.integers(3, 390, size=int(n)).tolist() for n in (5, 9, 3, 12)]
    prompts += [prompts[1], prompts[2][:40], a + b + [7], b + a + [7], a[:4] + b[:4] + [3], system[:20] + a + [9]]
    return prompts


def _run_by_hand(llm, sched, prompts, params):
    """Each prompt after the previous one finished (so its pages are cached), stepped with LLM.step."""
    from engine.runtime.sampling_params import resolve_seed
    tokens, reused = [], []
    for prompt in prompts:
        rid = sched.submit(prompt, params)
        seeds = {rid: resolve_seed(params)}
        first = None
        while sched.has_unfinished():
            out = llm.step(sched, seeds)
            if out is not None and first is None:
                first = out.record["reused_tokens"]
            for result in (out.finished if out is not None else []):
                tokens.append(result.token_ids)
        reused.append(first or 0)
    return tokens, reused


def _unit_verdict(page_key: Callable, lookup: Callable) -> str:
    """The first [x] verdict of exercises 1-2's checkers on these functions (run quietly), as a hint."""
    import contextlib
    import io
    for check, fn in ((check_page_key, page_key), (check_longest_cached_prefix, lookup)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            ok = check(fn)
        if not ok:
            line = next((l for l in out.getvalue().splitlines() if l.startswith("[x]")), "")
            return f"\n    the exercise's checker says: {line[4:]}" if line else ""
    return ""


def check_prefix_cache_in_llm(page_key: Callable, longest_cached_prefix: Callable, model_dir=None,
                              max_new_tokens: int = 6) -> bool:
    """Your page_key and longest_cached_prefix inside the scheduler: first over the PrefixDevice (every
    read checked against its own prefix), then a Scheduler(prefix_caching=True, page_key=yours,
    prefix_lookup=yours) over engine.LLM's KV pool, driven with LLM.step: the same tokens as without
    the cache, and the same cached tokens reused as with the engine's own functions."""
    title = "prefix cache inside the engine"
    prompts = _engine_workload()
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    fake_requests = [([t % (FAKE_VOCAB - 1) + 1 for t in p], params) for p in prompts]

    def fake(**functions):
        sched = Scheduler(PageAllocator(40, 4), 2, 32, 128, prefix_caching=True, **functions)
        tokens, _ = serve_fake(sched, fake_requests)
        return tokens, sched.hit_tokens
    want_tokens, want_hits = fake()
    try:
        got_tokens, got_hits = fake(page_key=page_key, prefix_lookup=longest_cached_prefix)
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (a function still raises NotImplementedError)")
        return False
    except WrongKV as e:
        who = fake_requests[e.request_id][0]
        hint = ""
        try:
            if page_key(0, (1, 2)) == page_key(1, (1, 2)):
                hint = " -- your page_key names a page without its parent: the same tokens at another position hit"
        except Exception:  # the learner's key may fail on these arguments: no hint then
            pass
        print(f"[x] {title} (the scheduler over the prefix-checking device): request {e.request_id} "
              f"({who}) was given a cached page (page {e.page}) whose K/V belong to another prefix: it reads "
              f"wrong K/V from position {e.position}" + (f", right after {e.context[-6:]}" if e.context else "")
              + (hint or _unit_verdict(page_key, longest_cached_prefix)))
        return False
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] {title} (the scheduler over the prefix-checking device) raised {type(e).__name__}: {e}")
        return False
    if got_tokens != want_tokens:
        first = next(i for i, (g, w) in enumerate(zip(got_tokens, want_tokens, strict=True)) if g != w)
        print(f"[x] {title} (prefix-checking device): request {first} generated {got_tokens[first]}, "
              f"expected {want_tokens[first]}" + _unit_verdict(page_key, longest_cached_prefix))
        return False
    if got_hits != want_hits:
        print(f"[x] {title} (prefix-checking device): every read was right, but {got_hits} prompt tokens were "
              f"reused where the engine's cache finds {want_hits}"
              + _unit_verdict(page_key, longest_cached_prefix))
        return False
    print(f"[OK] {title}: over the prefix-checking device, {len(prompts)} requests read only their own K/V and "
          f"reuse {got_hits} prompt tokens, as the engine's lookup does")

    import engine
    from engine.exercises.serving_check import tiny_model_dir
    llm = engine.LLM(model_dir or tiny_model_dir(), backend="numpy", max_context=128, max_seqs=2, page_size=4,
                     kv_cache_mib=0.2)
    runs: dict[str, dict] = {}
    for name in ("no cache", "engine", "yours"):
        if name == "yours":       # a scheduler of the engine's settings over its pool, with your functions
            sched = Scheduler(PageAllocator(llm.cache.num_pages, llm.page_size), llm.max_seqs,
                              llm.max_batch_tokens, llm.max_context, policy=llm.batching, admission=llm.admission,
                              chunked_prefill=llm.chunked_prefill, first_request_id=30_000, prefix_caching=True,
                              page_key=page_key, prefix_lookup=longest_cached_prefix)
        else:
            sched = llm.new_scheduler(first_request_id=10_000 * (len(runs) + 1))
            sched.prefix_caching = name == "engine"
        try:
            runs[name] = _run_by_hand(llm, sched, prompts, params)
        except Exception as e:  # the learner's bug, shown rather than raised
            print(f"[x] {title} (engine.LLM, {name}) raised {type(e).__name__}: {e}")
            llm.close()
            return False
    llm.close()
    (plain, _), (_, engine_reused), (yours, your_reused) = runs["no cache"], runs["engine"], runs["yours"]
    for i, (mine, real) in enumerate(zip(yours, plain, strict=True)):
        if mine != real:
            print(f"[x] {title} (engine.LLM, LLM.step): request {i} generated {mine} with your cache, "
                  f"{real} without a cache")
            return False
    if your_reused != engine_reused:
        print(f"[x] {title} (engine.LLM): tokens reused per request {your_reused}, the engine's lookup reuses "
              f"{engine_reused}")
        return False
    print(f"[OK] {title} (engine.LLM, a Scheduler with your page_key and lookup driven by LLM.step): the same "
          f"tokens as without a cache for all {len(prompts)} requests; prompt tokens reused per request "
          f"{your_reused}")
    return True


# ----------------------------------------------------------------------------- exercise 3: a reference-counted pool


class RefCountedPool:
    """Pages shared by reference count, the bookkeeping of engine/runtime/kv_allocator.py without its
    journal. Metadata only.

      self.free_list  a deque of the free pages: reserve() takes from the LEFT (the head: evicted first),
                      free pages join on the RIGHT (the tail)
      self.refs       per page, how many tables hold it (0: free)
      self.tables     {seq_id: [page, ...]}
      self.key_of     {page: key} the registered pages (a free one still holds its K/V: cached)
      self.page_of    {key: page}

    reserve, register and lookup are given; share and free are yours:

      share(seq_id, pages)
          Start seq's table (it has none) with these registered pages: each gets one more reader; a
          cached free page (count 0) leaves the free list, so that nobody's reserve() takes it.
      free(seq_id)
          Drop seq's table: each page has one reader less. A page nobody reads any more goes to the
          RIGHT end of the free list, keeping its key (still findable), the table's LAST page first.
          A page that another table still holds stays where it is.
    """

    def __init__(self, num_pages: int):
        self.free_list: deque[int] = deque(range(num_pages))
        self.refs = [0] * num_pages
        self.tables: dict[int, list[int]] = {}
        self.key_of: dict[int, Hashable] = {}
        self.page_of: dict[Hashable, int] = {}

    def reserve(self, seq_id: int, n_pages: int) -> list[int]:
        """Append n_pages pages from the head of the free list to seq's table; a cached page taken
        there is evicted (its key forgotten) before anyone writes it."""
        if n_pages > len(self.free_list):
            raise MemoryError(f"{n_pages} pages wanted, {len(self.free_list)} free")
        taken = [self.free_list.popleft() for _ in range(n_pages)]
        for page in taken:
            key = self.key_of.pop(page, None)
            if key is not None:
                del self.page_of[key]
            self.refs[page] = 1
        self.tables.setdefault(seq_id, []).extend(taken)
        return taken

    def register(self, page: int, key: Hashable) -> None:
        if key not in self.page_of and page not in self.key_of:
            self.key_of[page], self.page_of[key] = key, page

    def lookup(self, key: Hashable) -> int | None:
        return self.page_of.get(key)

    def share(self, seq_id: int, pages: list[int]) -> None:
        raise NotImplementedError

    def free(self, seq_id: int) -> None:
        raise NotImplementedError

    def snapshot(self) -> dict:
        return {"free_list": list(self.free_list), "refs": list(self.refs),
                "tables": {s: list(t) for s, t in self.tables.items()}, "keys": dict(self.key_of)}


class _RefPoolReference(RefCountedPool):
    def share(self, seq_id, pages):
        for page in pages:
            if self.refs[page] == 0:
                self.free_list.remove(page)
            self.refs[page] += 1
        self.tables[seq_id] = list(pages)

    def free(self, seq_id):
        for page in reversed(self.tables.pop(seq_id)):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_list.append(page)


def _pool_scripts(seed: int):
    """(num_pages, operations): reserve / register / share / free, with pages shared by several tables
    and a reader leaving while another one stays (a cancelled request beside a running one)."""
    yield 6, [("reserve", 0, 3), ("register", 0, 0), ("register", 0, 1), ("share", 1, 2), ("free", 0),
              ("reserve", 2, 4), ("free", 1), ("share", 3, 1), ("reserve", 4, 1), ("free", 3), ("free", 2),
              ("free", 4)]
    rng = random.Random(seed)
    for _ in range(30):
        ops: list[tuple] = []
        live: set[int] = set()
        for _ in range(rng.randrange(6, 24)):
            roll, seq = rng.random(), rng.randrange(6)
            if roll < 0.3 and seq not in live:
                ops.append(("reserve", seq, rng.randrange(1, 4)))
                live.add(seq)
            elif roll < 0.55 and live:
                ops.append(("register", rng.choice(sorted(live)), rng.randrange(3)))
            elif roll < 0.8 and seq not in live:
                ops.append(("share", seq, rng.randrange(1, 4)))
                live.add(seq)
            elif live:
                victim = rng.choice(sorted(live))
                ops.append(("free", victim))
                live.discard(victim)
        yield rng.randrange(3, 9), ops


def _pool_apply(pool: RefCountedPool, op) -> str | None:
    """Run one scripted operation on `pool`; None when it does not apply (the script adapts to the state)."""
    name, seq, n = op[0], op[1], op[2] if len(op) > 2 else 0
    if name == "reserve":
        if seq in pool.tables or n > len(pool.free_list):
            return None
        pool.reserve(seq, n)
    elif name == "register":
        table = pool.tables.get(seq)
        if not table:
            return None
        page = table[n % len(table)]
        pool.register(page, ("prefix", seq, page))
    elif name == "share":
        if seq in pool.tables or not pool.page_of:
            return None
        pool.share(seq, sorted(pool.page_of.values())[:n])
    elif name == "free":
        if seq not in pool.tables:
            return None
        pool.free(seq)
    return name


def _name_pool_mistake(op, before: dict, got: dict, want: dict) -> str:
    """What went wrong in the first operation whose state differs from the reference's."""
    readers = {page: [s for s, t in want["tables"].items() if page in t] for page in range(len(want["refs"]))}
    if op[0] == "free":
        for page in got["free_list"]:
            if readers[page]:
                return (f"page {page} went back to the free list while sequence {readers[page][0]} still reads it "
                        f"(it had {before['refs'][page]} readers, one left): the next reserve() may take it and "
                        f"overwrite the K/V that sequence is reading. Take one from its count; free it only at 0")
        if min(got["refs"]) < 0:
            return "a reference count went below 0: each table holds a page once, so it counts once"
        if len(got["keys"]) < len(want["keys"]):
            return ("a freed page lost its key: a free page keeps its K/V until reserve() evicts it, so the "
                    "next request with this prefix can still share it")
        if sorted(got["free_list"]) == sorted(want["free_list"]) and got["free_list"] != want["free_list"]:
            return ("the pages joined the free list in table order: the LAST page must go first, so that a "
                    "prefix's beginning (shared by more requests) is evicted after its end")
    if op[0] == "share":
        table = want["tables"][op[1]]
        if any(page in got["free_list"] for page in table):
            return ("a shared page stayed on the free list: a reserve() could evict it and overwrite it "
                    "under its new reader")
        if any(got["refs"][p] != want["refs"][p] for p in table):
            return "share() did not count the new reader of each page (refs[page] += 1)"
    return "the state differs from the engine's bookkeeping"


def check_ref_pool(cls: type) -> bool:
    """Your RefCountedPool subclass (share and free) keeps the same free list (order included), counts,
    tables and keys as the reference on ~30 scripts where several tables share pages and readers leave
    while others stay."""
    title = "reference-counted pool"
    count = 0
    for num_pages, ops in _pool_scripts(15):
        ok, yours = call_learner(title, f"{cls.__name__}({num_pages})", cls, num_pages)
        if not ok:
            return False
        ref = _RefPoolReference(num_pages)
        done: list = []
        for op in ops:
            before = ref.snapshot()
            applied = _pool_apply(ref, op)
            if applied is None:
                continue
            call = f"{op[0]}({', '.join(map(str, op[1:]))})" if op[0] != "share" else \
                f"share({op[1]}, {ref.tables[op[1]]})"
            ok, _ = call_learner(title, call, _pool_apply, yours, op)
            if not ok:
                return False
            got, want = yours.snapshot(), ref.snapshot()
            if got != want:
                print(f"[x] {title}: {call} on a pool of {num_pages} pages (after: {'; '.join(done) or 'nothing'}):"
                      f" {_name_pool_mistake(op, before, got, want)}\n    yours:     {got}\n    expected:  {want}")
                return False
            done.append(call)
        count += 1
    print(f"[OK] {title}: the same free list, counts, tables and keys on all {count} scripts")
    return True
