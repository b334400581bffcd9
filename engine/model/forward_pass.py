"""The whole forward pass of the Llama family (and Qwen2 / Qwen3, two switches of it, and Qwen3-MoE, whose
sparse layers route each token to a few experts in place of the MLP), composed from the ops (chapter 07;
the appendices on model families and on mixture of experts).

The same code runs on both backends: each op runs its NumPy reference on NumPy arrays and its CUDA
kernel on CuPy arrays. The input is a `ForwardBatch`: the token ids of one or more sequences packed
one after another, their absolute positions, and (with a cache) where each token's K/V goes and
which cache pages each sequence reads. One description covers every chapter:

    model.logits(ids)                      chapter 07: one prompt, no cache
    prefill of a prompt into the cache     chapter 08: positions 0..n-1, slot mapping
    decode step of many sequences          chapters 09-11: one token per sequence, any positions
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backend import Backend, resolve_backend
from engine.formats.config import ConfigError, HybridConfig, LlamaConfig, check_serving_args, load_config
from engine.model.hybrid_forward import PooledStates, hybrid_logits
from engine.model.hybrid_weights import load_hybrid_weights
from engine.model.kv_cache import KVCache
from engine.model.weights import load_weights
from engine.ops.argmax import argmax_rows
from engine.ops.attention import prefill_attention
from engine.ops.embedding import check_ids, embedding
from engine.ops.flash_attention import flash_attention, kernel_supports
from engine.ops.gated_delta import check_gpu_gated_delta
from engine.ops.kv_write import kv_write
from engine.ops.linear import linear
from engine.ops.moe import check_gpu_moe, moe
from engine.ops.paged_attention import check_gpu_shape, paged_attention
from engine.ops.rmsnorm import add_rmsnorm, rmsnorm
from engine.ops.rope import rope_qkv, rope_tables
from engine.ops.swiglu import swiglu
from engine.plugins import OVERRIDES


@dataclass
class ForwardBatch:
    """Host-side description of one forward pass (all int32 NumPy arrays).

    token_ids    [T]       tokens of all sequences, packed
    positions    [T]       absolute position of each token in its sequence
    cu_seqlens   [S + 1]   sequence s owns tokens cu_seqlens[s]:cu_seqlens[s+1]
    page_tables [S, MB]   cache pages of each sequence (None without a cache)
    slot_mapping [T]       cache slot (page * page_size + offset) of each token (None without a cache)
    logits_rows  [R]       rows whose logits are wanted (None = every row)
    feedback     (index [K] int32 host, ids [K] int32 on the backend) or None: async scheduling's tokens
                 that the previous step sampled; token_ids[index] are placeholders (-1)
    recurrent    [S] each sequence's RecurrentState (hybrid models with a cache, CPU; updated by the pass),
                 or a PooledStates (GPU: each sequence's slot in the device pools)
    """

    token_ids: np.ndarray
    positions: np.ndarray
    cu_seqlens: np.ndarray
    page_tables: np.ndarray | None = None
    slot_mapping: np.ndarray | None = None
    logits_rows: np.ndarray | None = None
    feedback: tuple | None = None
    recurrent: list | PooledStates | None = None

    @property
    def known_token_ids(self) -> np.ndarray:
        """The token ids given on the host (all but the fed-back placeholders)."""
        return self.token_ids if self.feedback is None else np.delete(self.token_ids, self.feedback[0])

    def with_feedback(self, ids):
        """`ids` [T] (token_ids on the backend) with the fed-back ids written in: in place on the GPU,
        a copy on the CPU (where ids may be token_ids itself)."""
        if self.feedback is None:
            return ids
        index, fed = self.feedback
        if isinstance(ids, np.ndarray):
            ids = ids.copy()
            ids[index] = fed
        else:
            import cupy as cp
            ids[cp.asarray(index)] = fed
        return ids

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
    def single(cls, token_ids, start_pos: int = 0, page_table=None, page_size: int | None = None,
               logits_rows=None) -> ForwardBatch:
        """One sequence; with a page table the tokens' slots are derived from it."""
        ids = np.asarray(token_ids, dtype=np.int32)
        pos = np.arange(start_pos, start_pos + len(ids), dtype=np.int32)
        tables = slots = None
        if page_table is not None:
            if page_size is None:
                raise ValueError("a page table needs its page_size")
            tables = np.asarray([page_table], dtype=np.int32)
            slots = (tables[0][pos // page_size] * page_size + pos % page_size).astype(np.int32)
        return cls(ids, pos, np.array([0, len(ids)], dtype=np.int32), tables, slots,
                   None if logits_rows is None else np.asarray(logits_rows, dtype=np.int32))


def check_token_ids(token_ids, vocab_size: int) -> np.ndarray:
    """A prompt's ids as int32 [T], else ValueError: a non-empty 1-D sequence of integers (no bools)
    in [0, vocab_size). The one check of ids given by a caller (Model.logits, ChatSession, LLM and
    RemoteLLM through engine/runtime/request.py)."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("token ids must be a non-empty 1-D sequence")
    if any(isinstance(t, (bool, np.bool_)) for t in token_ids) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got min {ids.min()} max {ids.max()}")
    return ids.astype(np.int32)


def check_vocab_fits(tokenizer, config: LlamaConfig) -> None:
    """Refuse a tokenizer that can produce ids the embedding table has no row for (an added token,
    or a converted vocabulary longer than the model's). A shorter vocabulary is fine: many models
    pad their embedding table."""
    if tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(f"the tokenizer has token ids up to {tokenizer.vocab_size - 1}, but the model's "
                          f"embedding table has {config.vocab_size} rows (config.json vocab_size): "
                          "tokenizer.json does not belong to this model")


def check_backend_runs(config: LlamaConfig, backend: Backend) -> None:
    """ConfigError unless this backend runs every layer of the model."""
    if backend.is_gpu:
        check_gpu_shape(config)
        check_gpu_moe(config)
        check_gpu_gated_delta(config)


class Model:
    """A loaded Llama-family model on one backend."""

    ROPE_START = 4096    # positions in the first RoPE table when no max_context is given; grows on demand

    def __init__(self, config: LlamaConfig, weights, backend: Backend, max_context: int | None = None):
        check_serving_args(config, max_context=max_context)
        check_backend_runs(config, backend)
        self.config, self.weights, self.backend = config, weights, backend
        self.max_context = int(max_context) if max_context is not None else config.max_position_embeddings
        # RoPE tables cover the context in use: all of an explicit max_context (they never move, so a
        # captured CUDA graph stays valid), else a first slice of max_position_embeddings, grown on demand.
        self.rope_positions = 0
        self._grow_rope(self.max_context if max_context is not None else min(self.max_context, self.ROPE_START))

    def _to_backend(self, host: np.ndarray | None):
        """A host array on the backend's device (None stays None)."""
        return self.backend.xp.asarray(host) if self.backend.is_gpu and host is not None else host

    def _grow_rope(self, positions: int) -> None:
        """Make the cos/sin tables [P, D/2] cover positions 0..positions-1 (at least doubling)."""
        if positions <= self.rope_positions:
            return
        size = min(self.max_context, max(positions, 2 * self.rope_positions))
        cos, sin = rope_tables(self.config, size)
        self.cos, self.sin = self._to_backend(cos), self._to_backend(sin)
        self.rope_positions = size

    def validate_tokens(self, token_ids) -> np.ndarray:
        return check_token_ids(token_ids, self.config.vocab_size)

    # ------------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, cache: KVCache | None = None):
        """Logits [R, V] (float32, on the backend's device) of batch.logits_rows (default: all)."""
        if batch.num_tokens and int(batch.positions.max()) >= self.max_context:
            raise ValueError(f"position {int(batch.positions.max())} is past the context of {self.max_context}")
        if batch.num_tokens:
            check_ids(batch.known_token_ids, self.config.vocab_size)    # host ids: no device traffic
            self._grow_rope(int(batch.positions.max()) + 1)
        if cache is None and not batch.fresh:
            raise ValueError("without a KV cache every sequence must start at position 0")
        if isinstance(self.config, HybridConfig) and cache is not None and batch.recurrent is None:
            raise ValueError(f"{self.config.model_type}: a pass with a cache needs each sequence's recurrent state "
                             "(ForwardBatch.recurrent)")
        dev = self._to_backend                                     # host int32 -> device once per step
        cached = cache is not None and not batch.fresh
        ids = batch.with_feedback(dev(batch.token_ids))
        recurrent = batch.recurrent
        if isinstance(recurrent, PooledStates):                    # GPU: each sequence's slot in the pools
            recurrent = PooledStates(recurrent.pools, dev(np.asarray(recurrent.slots, dtype=np.int32)))
        return self.run(
            ids, dev(batch.positions), batch.cu_seqlens, cache,
            slots=dev(batch.slot_mapping) if cache is not None else None,
            tables=dev(batch.page_tables) if cached else None,
            seq_idx=dev(batch.seq_idx) if cached else None,
            longest=int(batch.positions.max()) + 1 if cached else None,
            logits_rows=None if batch.logits_rows is None else dev(batch.logits_rows), recurrent=recurrent)

    def run(self, ids, pos, cu_seqlens, cache=None, *, slots=None, tables=None, seq_idx=None,
            longest=None, logits_rows=None, recurrent=None):
        """The layers on arrays already on the backend's device: no host<->device traffic here, so a
        GPU decode step can be captured once as a CUDA graph and replayed (engine/runtime/cuda_graphs.py).

        Attention: a decode step (one token per sequence, `tables` given) reads the cache with the
        paged kernel (`longest` bounds the context). A prefill (some sequence of cu_seqlens, on the
        host, brings several tokens) runs tiled flash attention: on fresh prompts over the batch's
        own K/V, and with `tables` (a chunk after a cached prefix) over the cache pages.
        A hybrid model (Qwen3.5) runs engine/model/hybrid_forward.py with the same attention; its
        linear layers carry `recurrent` (one RecurrentState per sequence on the CPU, a PooledStates on
        the GPU) instead of K/V. cu_seqlens None (a CUDA graph's decode step): one token per sequence.
        """
        cfg, w = self.config, self.weights
        if longest is not None:
            self._grow_rope(longest)                               # host int: no device traffic
        attend = self._attention(cu_seqlens, pos, tables, seq_idx, longest)
        if isinstance(cfg, HybridConfig):
            cu = None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int32)
            return hybrid_logits(cfg, w, ids, pos, cu, self.cos, self.sin, attend, cache, slots, recurrent,
                                 logits_rows, cu_device=None if cu is None else self._to_backend(cu))
        x = embedding(ids, w.embed)                                # [T, H] fp32 residual stream
        h = rmsnorm(x, w.layers[0].input_norm, cfg.rms_norm_eps)   # [T, H] (bf16 on the GPU)
        for i, lw in enumerate(w.layers):
            # --- attention block ---
            qkv = linear(h, lw.qkv)                                # [T, (Hq+2Hkv)*D] fp32
            qkv = rope_qkv(qkv, pos, self.cos, self.sin, cfg,      # (+ bias, q/k norm) q, k rotated
                           lw.qkv_bias, lw.q_norm, lw.k_norm)      # (bf16 on the GPU)
            k_cache = v_cache = None
            if cache is not None:
                k_cache, v_cache = cache.layer(i)
                kv_write(qkv, slots, k_cache, v_cache, cfg)
            attn = attend(qkv, k_cache, v_cache)                   # [T, Hq*D]
            o = linear(attn, lw.o)                                 # [T, H] fp32
            h = add_rmsnorm(x, o, lw.post_norm, cfg.rms_norm_eps)  # x += o; h = norm(x)
            # --- MLP block (on a Qwen3-MoE sparse layer: the router and its chosen experts) ---
            if lw.moe is not None:
                down = moe(h, lw.moe, cfg.moe)                     # [T, H] fp32
            else:
                gate_up = linear(h, lw.gate_up)                    # [T, 2I] fp32
                down = linear(swiglu(gate_up), lw.down)            # [T, H] fp32
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
        if tables is None and "attention" in OVERRIDES:      # a learner's chapter 06 stage (engine/plugins.py)
            return lambda qkv, kc, vc: prefill_attention(qkv, cu_seqlens, cfg)
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


def load_model(model_dir, backend: str | Backend = "auto", max_context: int | None = None,
               quantization: str | None = None, group_size: int | None = None) -> Model:
    """Load a Llama, Qwen2, Qwen3, Qwen3-MoE or Qwen3.5 model directory (config.json + safetensors) on the
    chosen backend.

    quantization "int8" | "int4": every projection quantized on load (weight-only, `group_size` inputs
    per scale and zero point: by default 128, or the largest group below it that the model's sizes
    take; chapter 18). An AWQ checkpoint (config.json's quantization_config) runs
    its own 4-bit weights without being asked."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    b = resolve_backend(backend)
    if isinstance(config, HybridConfig):
        if quantization is not None:
            raise ConfigError(f"quantization={quantization!r} is not supported for {config.model_type} models")
        check_backend_runs(config, b)              # before any weight is read
        return Model(config, load_hybrid_weights(model_dir, config, b), b, max_context)
    return Model(config, load_weights(model_dir, config, b, quantization, group_size), b, max_context)
