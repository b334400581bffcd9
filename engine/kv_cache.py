"""The KV cache: where the keys and values of past tokens live (chapters 08-11).

One layout serves every chapter: per layer, K and V are [num_blocks, block_size, Hkv, D].
  * chapter 08/09/10, contiguous: one block per sequence slot, block_size = max_context, so a
    sequence's tokens sit back to back and the slot reserves its whole context up front;
  * chapter 11, paged: many small blocks (16 tokens) shared by all sequences through block tables.
bf16 (uint16 bits) on the GPU, float32 on the CPU; allocated once, up front.
"""
from __future__ import annotations

from engine.backend import Backend, resolve_backend
from engine.config import LlamaConfig


class KVCache:
    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, backend: Backend | str = "numpy"):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"KV cache needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.config, self.backend = config, resolve_backend(backend)
        self.num_blocks, self.block_size = num_blocks, block_size
        xp = self.backend.xp
        dtype = xp.uint16 if self.backend.is_gpu else xp.float32
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.k = xp.zeros(shape, dtype=dtype)      # [L, NB, BS, Hkv, D]
        self.v = xp.zeros(shape, dtype=dtype)

    @classmethod
    def contiguous(cls, config: LlamaConfig, num_slots: int, max_context: int, backend="numpy") -> "KVCache":
        """num_slots sequences of up to max_context tokens each (block table of a slot: [slot])."""
        return cls(config, num_slots, max_context, backend)

    @classmethod
    def paged(cls, config: LlamaConfig, kv_cache_mib: float, page_size: int = 16, backend="numpy") -> "KVCache":
        """As many pages of page_size tokens as fit in kv_cache_mib (bf16 on the GPU, fp32 on CPU)."""
        b = resolve_backend(backend)
        per_page = config.kv_bytes_per_token(2 if b.is_gpu else 4) * page_size
        num_pages = int(kv_cache_mib * 2**20) // per_page
        if num_pages < 1:
            raise ValueError(f"kv_cache_mib={kv_cache_mib} holds no page of {page_size} tokens "
                             f"({per_page / 2**20:.2f} MiB each)")
        return cls(config, num_pages, page_size, b)

    def layer(self, i: int):
        """(k, v) of layer i, each [NB, BS, Hkv, D]."""
        return self.k[i], self.v[i]

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)
