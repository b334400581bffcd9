"""The KV cache: where the keys and values of past tokens live (chapters 08-11).

One layout serves every chapter: per layer, K and V are [num_pages, page_size, Hkv, D] (every layer
that keeps K/V: config.kv_layers, which for Qwen3.5 counts its full-attention layers only).
  * chapter 08/09/10, contiguous: one page per sequence slot, page_size = max_context, so a
    sequence's tokens sit back to back and the slot reserves its whole context up front;
  * chapter 11, paged: many small pages (16 tokens) shared by all sequences through page tables.
bf16 (uint16 bits) on the GPU, float32 on the CPU; allocated once, up front, after checking that
it fits in the memory there is (a typo in kv_cache_mib is a ValueError, not a machine that swaps).
"""
from __future__ import annotations

import math
import os

import numpy as np

from engine.backend import Backend, resolve_backend
from engine.checks import is_int, is_real
from engine.formats.config import LlamaConfig


def _count(name: str, value) -> int:
    if not is_int(value) or value <= 0:
        raise ValueError(f"KV cache {name} must be an integer > 0, got {value!r}")
    return int(value)


def available_bytes(backend: Backend) -> int:
    """Free device memory on the GPU; physical memory on the CPU."""
    if backend.is_gpu:
        return int(backend.xp.cuda.runtime.memGetInfo()[0])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_dtype(backend: Backend):
    """The element type of the cache: bf16 bits (uint16) on the GPU, float32 on the CPU."""
    return np.uint16 if backend.is_gpu else np.float32


def kv_bytes_per_token(config: LlamaConfig, backend: Backend) -> int:
    """Bytes one token's K and V take in this backend's cache, over all layers (the one rule the pool
    sizes, the contiguous slots and the engine's defaults are computed from)."""
    return config.kv_bytes_per_token(np.dtype(kv_dtype(backend)).itemsize)


class KVCache:
    def __init__(self, config: LlamaConfig, num_pages: int, page_size: int, backend: Backend | str = "numpy"):
        num_pages, page_size = _count("num_pages", num_pages), _count("page_size", page_size)
        self.config, self.backend = config, resolve_backend(backend)
        self.num_pages, self.page_size = num_pages, page_size
        xp = self.backend.xp
        dtype = kv_dtype(self.backend)
        shape = (config.kv_layers, num_pages, page_size, config.num_key_value_heads, config.head_dim)
        wanted = 2 * math.prod(shape) * np.dtype(dtype).itemsize          # K and V
        if wanted > available_bytes(self.backend):
            raise ValueError(f"a KV cache of {num_pages} x {page_size} tokens needs {wanted / 2**20:.0f} MiB, "
                             f"more than the {available_bytes(self.backend) / 2**20:.0f} MiB available")
        self.k = xp.zeros(shape, dtype=dtype)      # [L, NB, BS, Hkv, D]
        self.v = xp.zeros(shape, dtype=dtype)

    @classmethod
    def contiguous(cls, config: LlamaConfig, num_slots: int, max_context: int, backend="numpy") -> KVCache:
        """num_slots sequences of up to max_context tokens each (page table of a slot: [slot])."""
        return cls(config, num_slots, max_context, backend)

    @classmethod
    def paged(cls, config: LlamaConfig, kv_cache_mib: float, page_size: int = 16, backend="numpy") -> KVCache:
        """As many pages of page_size tokens as fit in kv_cache_mib (bf16 on the GPU, fp32 on CPU)."""
        b = resolve_backend(backend)
        if not is_real(kv_cache_mib) or not math.isfinite(kv_cache_mib) or kv_cache_mib <= 0:
            raise ValueError(f"kv_cache_mib must be a finite number > 0, got {kv_cache_mib!r}")
        page_size = _count("page_size", page_size)
        per_page = kv_bytes_per_token(config, b) * page_size
        num_pages = int(kv_cache_mib * 2**20) // per_page
        if num_pages < 1:
            raise ValueError(f"kv_cache_mib={kv_cache_mib} holds no page of {page_size} tokens "
                             f"({per_page / 2**20:.2f} MiB each)")
        return cls(config, num_pages, page_size, b)

    def layer(self, i: int):
        """(k, v) of layer i, each [NB, BS, Hkv, D]."""
        return self.k[i], self.v[i]

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the K/V of page src into page dst, every layer, for each (src, dst): copy-on-write
        of a shared prefix page (one gather-scatter per array, queued on the device's stream)."""
        xp = self.backend.xp
        src = xp.asarray([s for s, _ in pairs], dtype=xp.int64)
        dst = xp.asarray([d for _, d in pairs], dtype=xp.int64)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)
