"""The whole Llama-family forward pass, composed from the ops (chapter 07).

The same code runs on both backends: each op runs its NumPy reference on NumPy arrays and its CUDA
kernel on CuPy arrays. The input is a `ForwardBatch`: the token ids of one or more sequences packed
one after another, their absolute positions, and (with a cache) where each token's K/V goes and
which cache blocks each sequence reads. One description covers every chapter:

    model.logits(ids)                      chapter 07: one prompt, no cache
    prefill of a prompt into the cache     chapter 08: positions 0..n-1, slot mapping
    decode step of many sequences          chapters 09-11: one token per sequence, any positions
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backend import Backend, resolve_backend
from engine.config import LlamaConfig, load_config
from engine.kv_cache import KVCache
from engine.ops.argmax import argmax_rows
from engine.ops.attention import prefill_attention
from engine.ops.embedding import embedding
from engine.ops.flash_attention import flash_attention, kernel_supports
from engine.ops.linear import linear
from engine.ops.mlp import swiglu
from engine.ops.paged_attention import kv_write, paged_attention
from engine.ops.rmsnorm import add_rmsnorm, rmsnorm
from engine.ops.rope import rope_qkv, rope_tables
from engine.weights import load_weights


@dataclass
class ForwardBatch:
    """Host-side description of one forward pass (all int32 NumPy arrays).

    token_ids    [T]       tokens of all sequences, packed
    positions    [T]       absolute position of each token in its sequence
    cu_seqlens   [S + 1]   sequence s owns tokens cu_seqlens[s]:cu_seqlens[s+1]
    block_tables [S, MB]   cache blocks of each sequence (None without a cache)
    slot_mapping [T]       cache slot (block * block_size + offset) of each token (None without a cache)
    logits_rows  [R]       rows whose logits are wanted (None = every row)
    """

    token_ids: np.ndarray
    positions: np.ndarray
    cu_seqlens: np.ndarray
    block_tables: np.ndarray | None = None
    slot_mapping: np.ndarray | None = None
    logits_rows: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def seq_idx(self) -> np.ndarray:
        """[T] index of the sequence each token belongs to."""
        return np.repeat(np.arange(len(self.cu_seqlens) - 1, dtype=np.int32), np.diff(self.cu_seqlens))

    @property
    def fresh(self) -> bool:
        """Every sequence starts at position 0: its whole context is in this batch."""
        return bool(np.all(self.positions[self.cu_seqlens[:-1]] == 0))

    @classmethod
    def single(cls, token_ids, start_pos: int = 0, block_table=None, block_size: int | None = None,
               logits_rows=None) -> "ForwardBatch":
        """One sequence; with a block table the tokens' slots are derived from it."""
        ids = np.asarray(token_ids, dtype=np.int32)
        pos = np.arange(start_pos, start_pos + len(ids), dtype=np.int32)
        tables = slots = None
        if block_table is not None:
            tables = np.asarray([block_table], dtype=np.int32)
            slots = (tables[0][pos // block_size] * block_size + pos % block_size).astype(np.int32)
        return cls(ids, pos, np.array([0, len(ids)], dtype=np.int32), tables, slots,
                   None if logits_rows is None else np.asarray(logits_rows, dtype=np.int32))


class Model:
    """A loaded Llama-family model on one backend."""

    def __init__(self, config: LlamaConfig, weights, backend: Backend, max_context: int | None = None):
        self.config, self.weights, self.backend = config, weights, backend
        self.max_context = int(max_context or config.max_position_embeddings)
        cos, sin = rope_tables(config, self.max_context)          # [P, D/2] each, computed once
        self.cos, self.sin = self._to_backend(cos), self._to_backend(sin)

    def _to_backend(self, host: np.ndarray):
        return self.backend.xp.asarray(host) if self.backend.is_gpu else host

    def validate_tokens(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("token ids must be a non-empty 1-D sequence")
        if any(isinstance(t, (bool, np.bool_)) for t in token_ids) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got min {ids.min()} max {ids.max()}")
        return ids.astype(np.int32)

    # ------------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, cache: KVCache | None = None):
        """Logits [R, V] (float32, on the backend's device) of batch.logits_rows (default: all)."""
        if batch.num_tokens and int(batch.positions.max()) >= self.max_context:
            raise ValueError(f"position {int(batch.positions.max())} is past the context of {self.max_context}")
        if cache is None and not batch.fresh:
            raise ValueError("without a KV cache every sequence must start at position 0")
        dev = self._to_backend                                     # host int32 -> device once per step
        cached = cache is not None and not batch.fresh
        return self.run(
            dev(batch.token_ids), dev(batch.positions), batch.cu_seqlens, cache,
            slots=dev(batch.slot_mapping) if cache is not None else None,
            tables=dev(batch.block_tables) if cached else None,
            seq_idx=dev(batch.seq_idx) if cached else None,
            longest=int(batch.positions.max()) + 1 if cached else None,
            logits_rows=None if batch.logits_rows is None else dev(batch.logits_rows))

    def run(self, ids, pos, cu_seqlens, cache=None, *, slots=None, tables=None, seq_idx=None,
            longest=None, logits_rows=None):
        """The layers on arrays already on the backend's device: no host<->device traffic here, so a
        GPU decode step can be captured once as a CUDA graph and replayed (engine/cuda_graph.py).

        Attention: a decode step (one token per sequence, `tables` given) reads the cache with the
        paged kernel (`longest` bounds the context). A prefill (some sequence of cu_seqlens, on the
        host, brings several tokens) runs tiled flash attention: on fresh prompts over the batch's
        own K/V, and with `tables` (a chunk after a cached prefix) over the cache pages.
        """
        cfg, w = self.config, self.weights
        attend = self._attention(cu_seqlens, pos, tables, seq_idx, longest)
        x = embedding(ids, w.embed)                                # [T, H] fp32 residual stream
        h = rmsnorm(x, w.layers[0].input_norm, cfg.rms_norm_eps)   # [T, H] (bf16 on the GPU)
        for i, lw in enumerate(w.layers):
            # --- attention block ---
            qkv = linear(h, lw.qkv)                                # [T, (Hq+2Hkv)*D] fp32
            qkv = rope_qkv(qkv, pos, self.cos, self.sin, cfg)      # q, k rotated (bf16 on the GPU)
            k_cache = v_cache = None
            if cache is not None:
                k_cache, v_cache = cache.layer(i)
                kv_write(qkv, slots, k_cache, v_cache, cfg)
            attn = attend(qkv, k_cache, v_cache)                   # [T, Hq*D]
            o = linear(attn, lw.o)                                 # [T, H] fp32
            h = add_rmsnorm(x, o, lw.post_norm, cfg.rms_norm_eps)  # x += o; h = norm(x)
            # --- MLP block ---
            gate_up = linear(h, lw.gate_up)                        # [T, 2I] fp32
            down = linear(swiglu(gate_up), lw.down)                # [T, H] fp32
            next_norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.norm
            h = add_rmsnorm(x, down, next_norm, cfg.rms_norm_eps)  # x += down; h = norm(x) (final norm last)
        if logits_rows is not None:
            h = h[logits_rows]
        return linear(h, w.lm_head)                                # [R, V] fp32

    def _attention(self, cu_seqlens, pos, tables, seq_idx, longest):
        """attend(qkv, k_cache, v_cache) -> [T, Hq*D] for this batch, chosen once per forward pass."""
        cfg = self.config
        decode = tables is not None and (cu_seqlens is None or int(np.max(np.diff(cu_seqlens))) <= 1)
        if decode:
            return lambda qkv, kc, vc: paged_attention(qkv, kc, vc, tables, seq_idx, pos, cfg, longest)
        if self.backend.is_gpu and not kernel_supports(cfg):
            # before sm_80 (no bf16 mma.sync) or an unusual head_dim: the chapter 06 and 11 kernels
            if tables is not None:
                return lambda qkv, kc, vc: paged_attention(qkv, kc, vc, tables, seq_idx, pos, cfg, longest)
            return lambda qkv, kc, vc: prefill_attention(qkv, cu_seqlens, cfg)
        cu_dev = self._to_backend(np.asarray(cu_seqlens, dtype=np.int32)) if self.backend.is_gpu else None
        if tables is None:                                         # fresh prompts: K/V from qkv itself
            return lambda qkv, kc, vc: flash_attention(qkv, cu_seqlens, pos, cfg, cu_seqlens_device=cu_dev)
        return lambda qkv, kc, vc: flash_attention(qkv, cu_seqlens, pos, cfg, kc, vc, tables,
                                                   cu_seqlens_device=cu_dev)

    def logits(self, token_ids) -> np.ndarray:
        """float32 [len(token_ids), vocab]: one full causal pass over the tokens, no cache."""
        ids = self.validate_tokens(token_ids)
        if len(ids) > self.max_context:
            raise ValueError(f"{len(ids)} tokens do not fit the context of {self.max_context}")
        out = self.forward(ForwardBatch.single(ids))
        return self.backend.xp.asnumpy(out) if self.backend.is_gpu else out

    def greedy(self, logits):
        """Row-wise argmax, on the device for the GPU backend."""
        return argmax_rows(logits)


def load_model(model_dir, backend: str | Backend = "auto", max_context: int | None = None) -> Model:
    """Load a Llama-family model directory (config.json + safetensors) on the chosen backend."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    b = resolve_backend(backend)
    return Model(config, load_weights(model_dir, config, b), b, max_context)
