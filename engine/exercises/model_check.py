"""The whole-model checker: your stages inside the real model, compared with the engine's, stage by stage.

    from engine.exercises.model_check import check_in_model
    check_in_model({"rmsnorm": my_rmsnorm})          # prints a verdict and the text the model wrote

It runs the default model (SmolLM2-135M-Instruct, NumPy backend) twice on the same chat prompt, once
with the engine's stages and once with yours plugged in (engine.use_stage), and records the output of
every stage call: per forward pass, per layer, per token. Each run is one full causal pass
(`model.logits` of the prompt, no cache) followed by greedy generation through a KV cache (prefill,
then one decode step per token: the KV write, paged attention and sampling run there). The first
recorded output that differs beyond the tolerance names the stage, the layer and the token position
where your code first changed the model; if none differs, the whole model matches. Either way it
prints the text the model generated through your code.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.ops.attention import causal_attention_ref
from engine.ops.embedding import embedding_ref
from engine.ops.gated_delta import gated_delta_chunked_ref
from engine.ops.kv_write import kv_write_ref
from engine.ops.paged_attention import paged_attention_ref
from engine.ops.rmsnorm import add_rmsnorm_ref, rmsnorm_ref
from engine.ops.rope import rope_ref
from engine.ops.sampling import sample_ref
from engine.ops.swiglu import swiglu_ref
from engine.plugins import STAGES, use_stages
from engine.runtime.sampling_params import SamplingParams

# The engine's NumPy implementation of every stage, in the signature engine/plugins.py documents.
ENGINE_STAGES: dict[str, Callable] = {
    "embedding": embedding_ref, "rmsnorm": rmsnorm_ref, "add_rmsnorm": add_rmsnorm_ref, "rope": rope_ref,
    "attention": causal_attention_ref, "swiglu": swiglu_ref, "sampling": sample_ref, "kv_write": kv_write_ref,
    "paged_attention": paged_attention_ref, "gated_delta": gated_delta_chunked_ref,
}
DEFAULT_PROMPT = "What is the capital of France?"
RTOL, ATOL = 1e-4, 1e-6        # per token row: max|yours - engine| <= RTOL * max|engine row| + ATOL


@dataclass
class Record:
    stage: str
    pass_index: int        # forward pass: 0 = the full causal pass, 1 = the prefill, 2.. = decode steps
    call: int              # the how-many-th call of this stage in the pass (the layer, mostly)
    rows: np.ndarray       # [T, ...] one row per token (sampling: [1], the token id)
    positions: np.ndarray | None  # [T] the absolute position of each row (filled in from the pass's rope)


@dataclass
class ModelCheck:
    """The verdict. Truthy only when your stages ran and the whole model matched."""

    ok: bool
    stages: list[str]
    text: str = ""
    engine_text: str = ""
    stage: str | None = None
    layer: str | None = None
    position: int | None = None
    max_error: float = 0.0
    records: int = 0
    messages: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok


@functools.lru_cache(maxsize=2)
def _default_model(model_dir: str | None, max_context: int):
    import engine
    model_dir = model_dir or str(engine.ensure_default_model())
    return engine.load_model(model_dir, backend="numpy", max_context=max_context), engine.load_tokenizer(model_dir)


class _Recorder:
    """Wraps each stage so that every call's output is kept (as float64 rows) with its pass and position."""

    def __init__(self):
        self.records: list[Record] = []
        self.pass_index = -1
        self.calls: dict[str, int] = {}
        self.positions = np.zeros(0, dtype=np.int64)

    def new_pass(self) -> None:
        self.pass_index += 1
        self.calls = {}

    def keep(self, stage: str, rows, positions=None) -> None:
        call = self.calls.get(stage, 0)
        self.calls[stage] = call + 1
        rows = np.array(rows, dtype=np.float64, ndmin=1)
        self.records.append(Record(stage, self.pass_index, call, rows, positions))

    def finish(self) -> list[Record]:
        """Give every record of a pass the positions its rope call saw (the norms before it had none)."""
        by_pass = {r.pass_index: r.positions for r in self.records if r.stage == "rope" and r.call == 0}
        for r in self.records:
            if r.positions is None:
                r.positions = by_pass.get(r.pass_index, np.arange(len(r.rows)))
        return self.records

    def wrap(self, stage: str, fn: Callable) -> Callable:
        keep = self.keep
        recorder = self
        if stage == "embedding":
            def embedding(ids, table):
                recorder.new_pass()
                out = fn(ids, table)
                keep(stage, out)
                return out
            return embedding
        if stage == "rope":
            def rope(x, positions, cos, sin):
                recorder.positions = np.asarray(positions).astype(np.int64)
                out = fn(x, positions, cos, sin)
                keep(stage, out, recorder.positions)
                return out
            return rope
        if stage == "add_rmsnorm":
            def add_rmsnorm(residual, delta, w, eps):
                out = fn(residual, delta, w, eps)
                keep("add_rmsnorm (residual)", residual)
                keep(stage, out)
                return out
            return add_rmsnorm
        if stage == "kv_write":
            def kv_write(k, v, k_cache, v_cache, slot_mapping):
                fn(k, v, k_cache, v_cache, slot_mapping)
                Hkv, D = k_cache.shape[2:]
                slots = np.asarray(slot_mapping)
                written = np.concatenate([k_cache.reshape(-1, Hkv, D)[slots], v_cache.reshape(-1, Hkv, D)[slots]], 1)
                keep(stage, written)
            return kv_write
        if stage == "sampling":
            def sampling(logits, temperature, top_k, top_p, u):
                token = fn(logits, temperature, top_k, top_p, u)
                keep(stage, [token], self.positions[-1:] + 1)
                return token
            return sampling

        def other(*args):
            out = fn(*args)
            keep(stage, out)
            return out
        return other


def _stage_set(yours: dict[str, Callable]) -> dict[str, Callable]:
    """Every stage: yours where given, else the engine's. Your rmsnorm alone also does add_rmsnorm's norm."""
    stages = {**ENGINE_STAGES, **yours}
    if "rmsnorm" in yours and "add_rmsnorm" not in yours:
        norm = yours["rmsnorm"]

        def add_then_your_rmsnorm(residual, delta, w, eps):
            residual += delta
            return norm(residual, w, eps)
        stages["add_rmsnorm"] = add_then_your_rmsnorm
    return stages


def _run(model, prompt_ids: list[int], stages: dict[str, Callable], params: SamplingParams):
    """(records, generated ids, final-pass logits) of one full causal pass plus one greedy generation."""
    from engine.runtime.chat_session import ChatSession
    recorder = _Recorder()
    with use_stages({name: recorder.wrap(name, fn) for name, fn in stages.items()}):
        logits = model.logits(prompt_ids)
        recorder.keep("logits", logits)
        session = ChatSession(model)
        tokens = list(session.stream(prompt_ids, params))
    return recorder.finish(), tokens


@functools.lru_cache(maxsize=4)
def _engine_run(model_dir: str | None, max_context: int, prompt_ids: tuple, params: SamplingParams):
    """The engine's own run, recorded once per prompt (the records are only read)."""
    model, _ = _default_model(model_dir, max_context)
    return _run(model, list(prompt_ids), ENGINE_STAGES, params)


def _layer_label(stage: str, call: int, num_layers: int) -> str:
    if stage in ("embedding", "logits", "sampling"):
        return "-"
    if stage == "rmsnorm":
        return "layer 0 (input norm)"
    if stage.startswith("add_rmsnorm"):
        layer, second = divmod(call, 2)
        if second and layer == num_layers - 1:
            return f"layer {layer} (the final norm)"
        return f"layer {layer} ({'after the MLP' if second else 'after attention'})"
    return f"layer {call}"


def _first_divergence(ref: list[Record], got: list[Record]):
    """(index, worst row, max error) of the first record that differs beyond tolerance, else None."""
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if (a.stage, a.pass_index, a.call) != (b.stage, b.pass_index, b.call) or a.rows.shape != b.rows.shape:
            return i, 0, float("inf")
        err = np.abs(a.rows - b.rows).reshape(len(a.rows), -1).max(axis=1)          # [T]
        err = np.where(np.isnan(err), np.inf, err)
        tol = RTOL * np.abs(a.rows).reshape(len(a.rows), -1).max(axis=1) + ATOL      # [T]
        if a.stage == "sampling":
            tol = 0.0                                                                 # token ids: exact
        bad = np.flatnonzero(err > tol)
        if bad.size:
            return i, int(bad[0]), float(err[bad[0]])
    if len(ref) != len(got):
        return min(len(ref), len(got)), 0, float("inf")
    return None


def check_in_model(yours: dict[str, Callable], prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 16, *,
                   sampling: SamplingParams | None = None, model_dir: str | None = None,
                   max_context: int = 256) -> ModelCheck:
    """Run the default model with and without your stages; print where it first diverged (or that the
    whole model matches) and the text it generated through your code. Truthy only on a full match.
    Generation is greedy unless `sampling` (an engine.SamplingParams; give it a seed) says otherwise."""
    params = sampling or SamplingParams(max_new_tokens=max_new_tokens)
    if params.seed is None and not params.greedy:
        raise ValueError("give the SamplingParams a seed: both runs must draw the same random numbers")
    unknown = sorted(set(yours) - set(STAGES))
    if unknown or not yours:
        raise ValueError(f"stages must be a non-empty dict over {', '.join(STAGES)}; unknown: {unknown}")
    if "moe_router" in yours:      # SmolLM2 is dense: the router would never run, and 'match' would mean nothing
        raise ValueError("the default model has no experts, so a moe_router never runs in it: check it with "
                         "engine.exercises.appendix_moe.check_router_in_model")
    names = ", ".join(yours)
    model, tok = _default_model(model_dir, max_context)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
    ref, ref_tokens = _engine_run(model_dir, max_context, tuple(ids), params)
    engine_text = tok.decode(ref_tokens, skip_special_tokens=True)
    try:
        got, tokens = _run(model, ids, _stage_set(yours), params)
    except NotImplementedError:
        print(f"[ ] your {names} inside the model: not attempted yet (it still raises NotImplementedError)")
        return ModelCheck(False, list(yours), engine_text=engine_text)
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] your {names} raised {type(e).__name__} inside the model: {e}")
        return ModelCheck(False, list(yours), engine_text=engine_text)
    text = tok.decode(tokens, skip_special_tokens=True)
    report = ModelCheck(True, list(yours), text, engine_text, records=len(ref))
    found = _first_divergence(ref, got)
    if found is None:
        largest = max(float(np.max(np.abs(a.rows - b.rows))) for a, b in zip(ref, got, strict=True))
        print(f"[OK] your {names} inside {model.config.num_hidden_layers}-layer SmolLM2: all {len(ref)} stage "
              f"outputs of {ref[-1].pass_index + 1} forward passes match the engine's (largest difference "
              f"{largest:.2g})")
        report.max_error = largest
    else:
        i, row, err = found
        r = ref[i] if i < len(ref) else got[i]
        report.ok = False
        report.stage, report.max_error = r.stage, err
        report.layer = _layer_label(r.stage, r.call, model.config.num_hidden_layers)
        report.position = int(r.positions[row]) if row < len(r.positions) else None
        where = "the full causal pass" if r.pass_index == 0 else (
            "the prefill" if r.pass_index == 1 else f"decode step {r.pass_index - 1}")
        print(f"[x] your {names} inside the model: first divergence at stage '{r.stage}', {report.layer}, "
              f"token position {report.position} ({where}): max |error| {err:.3g} "
              f"(tolerance {RTOL:g} x the row's largest value + {ATOL:g})")
    print(f"    the model wrote through your {names}: {text!r}")
    if not report.ok:
        print(f"    with the engine's own stages it writes: {engine_text!r}")
    return report
