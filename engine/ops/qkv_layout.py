"""The fused QKV buffer: one projection writes every token's query, key and value heads side by side.

A row of qkv is [Hq query heads | Hkv key heads | Hkv value heads], each head D wide. Attention
(chapter 06), the KV cache write and paged attention (chapter 11) and flash attention (chapter 13)
all read it through `split_qkv`.
"""
from __future__ import annotations

import numpy as np

from engine.formats.config import LlamaConfig


def split_qkv(qkv: np.ndarray, config: LlamaConfig):
    """[T, (Hq + 2Hkv) * D] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (views)."""
    T, D = qkv.shape[0], config.head_dim
    heads = qkv.reshape(T, -1, D)
    Hq, Hkv = config.num_attention_heads, config.num_key_value_heads
    return heads[:, :Hq], heads[:, Hq:Hq + Hkv], heads[:, Hq + Hkv:]
