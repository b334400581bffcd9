"""Prefix caching (chapter 15): the keys that name full KV pages, and the longest cached prefix.

A full page of a sequence holds the K/V of `page_size` tokens, and those K/V depend on every token
before them (attention mixed them into each layer's input). So a page is named by a *chain*:

    key(page 0) = page_key(root, tokens[0:P])
    key(page i) = page_key(serial of page i-1's registration, tokens[i*P:(i+1)*P])

The root stands for what else changes K/V in a live engine: the stages a learner has plugged in
(engine/plugins.py); the model and its dtype are fixed for the pool's life. The key is a plain tuple
and the pages are found in a dict, so a hit compares the tokens themselves: two different prefixes
can never share a key (a parent is named by a registration number that is never given twice, so
once a page is evicted and reused no stale child matches it). There is no hash collision to argue
about; Python's hash only picks the dict bucket.

Only full pages are named: a partial page is still being written by its sequence (a decode step
adds the next token), so nobody else may read it as if it were final.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

from engine.runtime.kv_allocator import KVAllocator

PageKey = Callable[[Hashable, tuple[int, ...]], Hashable]
PrefixLookup = Callable[..., list[int]]     # (allocator, tokens, root, page_key) -> registered pages


def page_key(parent: Hashable, tokens: tuple[int, ...]) -> Hashable:
    """The name of a full page: its parent's (the root, or the previous page's registration number)
    and its own tokens. A dict compares the whole tuple on a hit: exact, never a collision."""
    return (parent, tokens)


def root_key() -> Hashable:
    """What the first page's parent is named by: the set of stages plugged in right now (a learner's
    RoPE writes other K/V than the engine's). Each `use_stage` block has its own serial number."""
    from engine.plugins import OVERRIDES
    return ("root",) + tuple(sorted((stage, o.serial) for stage, o in OVERRIDES.items()))


def cached_prefix(allocator: KVAllocator, tokens: list[int], root: Hashable, key: PageKey = page_key,
                  known: tuple[list[int], list[int]] | None = None) -> list[int]:
    """The registered pages that hold the longest run of full pages of `tokens` from position 0:
    walk the chain, stop at the first page not cached. `known`: (pages, their serials) of an earlier
    walk over the same tokens and root; the walk goes on from where they still hold."""
    size = allocator.page_size
    pages: list[int] = []
    parent: Hashable = root
    if known is not None:            # the earlier walk, as far as its pages still carry those names
        for held, serial in zip(*known, strict=True):
            if allocator.serial_or_none(held) != serial:
                break
            pages.append(held)
            parent = serial
    for start in range(len(pages) * size, len(tokens) - size + 1, size):
        page = allocator.lookup(key(parent, tuple(tokens[start:start + size])))
        if page is None:
            break
        pages.append(page)
        parent = allocator.serial(page)
    return pages
