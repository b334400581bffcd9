"""Generation with the KV cache (chapter 08) against the no-cache oracle, on the NumPy backend.

Greedy tokens through ChatSession.stream and LLM.generate must equal, at every step and exactly,
the argmax of a full causal pass over everything so far. Stopping rules: eos (any of several ids,
from config.json or generation_config.json), max_new_tokens, the end of the context ("length"),
ignore_eos; prompts that cannot fit are refused before any forward pass. The eos id is chosen after
watching what the random model actually emits, so the "stop" path really runs.
"""
import json
import shutil

import numpy as np
import pytest
from helpers.oracle import ForwardCounter, gen_model_dir, greedy_no_cache, hf_model, needs_transformers, relative_error

from engine.model.forward_pass import ForwardBatch, load_model
from engine.model.kv_cache import KVCache
from engine.runtime.chat_session import ChatSession
from engine.runtime.llm import LLM
from engine.runtime.sampling_params import SamplingParams

MAX_CONTEXT = 64
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model(gen_model_dir(), backend="numpy", max_context=MAX_CONTEXT)


def prompts(vocab_size, lengths=(1, 6, 17), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def stream_all(session, prompt, params):
    return list(session.stream(prompt, params)), session.finish_reason


@pytest.fixture(scope="module")
def eos_case(model):
    """(prompt, greedy tokens ignoring eos, index j, eos id): greedy[j] appears there for the first
    time (j >= 2), so making it the eos must stop generation right after it."""
    for prompt in prompts(model.config.vocab_size, lengths=(5, 9, 12, 3), seed=1):
        tokens, _ = greedy_no_cache(model, prompt, 16, ignore_eos=True)
        for j in range(2, len(tokens)):
            if tokens[j] not in tokens[:j] and tokens[j] not in prompt:
                return prompt, tokens, j, tokens[j]
    pytest.fail("the random model never emits a fresh token: pick another GEN_CONFIG seed")


def test_cached_logits_match_full_recomputation(model):
    """Prefill into the cache, then decode one token at a time: the logits of every step are the
    last row of a full pass over the whole sequence."""
    prompt = prompts(model.config.vocab_size, lengths=(11,))[0]
    cache = KVCache.contiguous(model.config, 1, MAX_CONTEXT)
    sequence = list(prompt)
    logits = model.forward(ForwardBatch.single(prompt, 0, [0], MAX_CONTEXT, logits_rows=[len(prompt) - 1]), cache)
    for _ in range(12):
        full = model.logits(sequence)[-1:]
        assert relative_error(logits, full) < 1e-5
        token = int(np.argmax(full[0]))
        assert int(np.argmax(logits[0])) == token
        sequence.append(token)
        logits = model.forward(ForwardBatch.single([token], len(sequence) - 1, [0], MAX_CONTEXT), cache)


def test_chat_session_greedy_equals_full_recomputation(model):
    for prompt in prompts(model.config.vocab_size):
        expected, _ = greedy_no_cache(model, prompt, 20, ignore_eos=True)
        assert len(set(expected)) > 3, "the oracle output is degenerate: the test would prove little"
        tokens, reason = stream_all(ChatSession(model), prompt, SamplingParams(max_new_tokens=20, **GREEDY))
        assert (tokens, reason) == (expected, "length")


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_llm_generate_greedy_equals_full_recomputation(model, kv_cache):
    llm = LLM(gen_model_dir(), backend="numpy", kv_cache=kv_cache, max_context=MAX_CONTEXT)
    batch = prompts(model.config.vocab_size)
    results = llm.generate(batch, SamplingParams(max_new_tokens=20, **GREEDY))
    for prompt, result in zip(batch, results):
        assert result.prompt_token_ids == prompt
        expected, _ = greedy_no_cache(model, prompt, 20, ignore_eos=True)
        assert (result.token_ids, result.finish_reason) == (expected, "length")
        assert result.text == ""                    # no tokenizer.json in a random model directory


def test_eos_stops_generation(model, eos_case):
    prompt, greedy, j, eos = eos_case
    unused = next(t for t in range(model.config.vocab_size) if t not in greedy)
    eos_dir = gen_model_dir(eos=[unused, eos])     # same weights, two eos ids
    eos_model = load_model(eos_dir, backend="numpy", max_context=MAX_CONTEXT)
    params = SamplingParams(max_new_tokens=16)
    assert greedy_no_cache(eos_model, prompt, 16, eos=(unused, eos)) == (greedy[:j + 1], "stop")
    assert stream_all(ChatSession(eos_model), prompt, params) == (greedy[:j + 1], "stop")
    [result] = LLM(eos_dir, backend="numpy", max_context=MAX_CONTEXT).generate([prompt], params)
    assert (result.token_ids, result.finish_reason) == (greedy[:j + 1], "stop")


def test_ignore_eos_runs_past_eos(eos_case):
    prompt, greedy, _, eos = eos_case
    eos_dir = gen_model_dir(eos=eos)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    eos_model = load_model(eos_dir, backend="numpy", max_context=MAX_CONTEXT)
    assert stream_all(ChatSession(eos_model), prompt, params) == (greedy, "length")
    [result] = LLM(eos_dir, backend="numpy", max_context=MAX_CONTEXT).generate([prompt], params)
    assert (result.token_ids, result.finish_reason) == (greedy, "length")


def test_eos_from_generation_config(tmp_path, eos_case):
    """config.json says eos 2; generation_config.json adds the id the model emits (Llama 3.2 style)."""
    prompt, greedy, j, eos = eos_case
    model_dir = tmp_path / "model"
    shutil.copytree(gen_model_dir(), model_dir)
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == 2 and eos != 2
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 2]}))
    llm = LLM(model_dir, backend="numpy", max_context=MAX_CONTEXT)
    [result] = llm.generate([prompt], SamplingParams(max_new_tokens=16))
    assert (result.token_ids, result.finish_reason) == (greedy[:j + 1], "stop")


@pytest.mark.parametrize("n", [0, 1, 7])
def test_max_new_tokens(model, n):
    prompt = prompts(model.config.vocab_size, lengths=(5,))[0]
    expected = greedy_no_cache(model, prompt, n, ignore_eos=True)[0]
    assert len(expected) == n
    assert stream_all(ChatSession(model), prompt, SamplingParams(max_new_tokens=n, **GREEDY)) == (expected, "length")
    [result] = LLM(gen_model_dir(), backend="numpy", max_context=MAX_CONTEXT).generate(
        [prompt], SamplingParams(max_new_tokens=n, **GREEDY))
    assert (result.token_ids, result.finish_reason) == (expected, "length")


@pytest.mark.parametrize("prompt_len", [20, 23])
@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_end_of_context_finishes_with_length(prompt_len, kv_cache):
    """max_context 24: prompt + generated stops at exactly 24 tokens, whatever max_new_tokens says."""
    small = load_model(gen_model_dir(), backend="numpy", max_context=24)
    prompt = prompts(small.config.vocab_size, lengths=(prompt_len,), seed=3)[0]
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    expected, _ = greedy_no_cache(small, prompt, 100, ignore_eos=True)
    assert len(expected) == 24 - prompt_len
    assert stream_all(ChatSession(small), prompt, params) == (expected, "length")
    [result] = LLM(gen_model_dir(), backend="numpy", kv_cache=kv_cache, max_context=24).generate([prompt], params)
    assert (result.token_ids, result.finish_reason) == (expected, "length")


@pytest.mark.parametrize("prompt_len", [24, 25, 40])
def test_prompt_that_does_not_fit_is_refused_before_anything_runs(monkeypatch, prompt_len):
    small = load_model(gen_model_dir(), backend="numpy", max_context=24)
    counter = ForwardCounter(small)
    monkeypatch.setattr(small, "forward", counter)
    session = ChatSession(small)
    too_long = list(range(1, prompt_len + 1))
    with pytest.raises(ValueError):
        next(session.stream(too_long, SamplingParams(max_new_tokens=4)))
    assert counter.tokens == [] and session.cached == []

    llm = LLM(gen_model_dir(), backend="numpy", max_context=24)
    counter = ForwardCounter(llm.model)
    monkeypatch.setattr(llm.model, "forward", counter)
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], too_long], SamplingParams(max_new_tokens=4))
    assert counter.tokens == []


def test_multi_turn_prefix_reuse_equals_a_fresh_session(model, monkeypatch):
    counter = ForwardCounter(model)
    monkeypatch.setattr(model, "forward", counter)
    params = SamplingParams(max_new_tokens=8, **GREEDY)
    session = ChatSession(model)
    p1 = prompts(model.config.vocab_size, lengths=(9,), seed=4)[0]
    a1, _ = stream_all(session, p1, params)
    assert a1 == greedy_no_cache(model, p1, 8, ignore_eos=True)[0]

    def next_turn(prompt, reused):
        """The turn's tokens equal a fresh session's, and only the tokens after `reused` are fed."""
        counter.tokens.clear()
        tokens, reason = stream_all(session, prompt, params)
        assert counter.tokens[0] == len(prompt) - reused        # the prefill of this turn
        assert (tokens, reason) == stream_all(ChatSession(model), prompt, params)
        return tokens

    p2 = p1 + a1 + [5, 77, 300]                          # the conversation continues
    a2 = next_turn(p2, reused=len(p1) + len(a1) - 1)     # the last answer token was never fed
    p3 = p2[:6] + [11, 12]                                # history edited: only a short prefix survives
    next_turn(p3, reused=6)
    next_turn(p3, reused=len(p3) - 1)                     # same prompt again: only its last token
    next_turn(p3[:4], reused=3)                           # a strict prefix of what is cached
    session.reset()
    next_turn(p2 + a2, reused=0)


@needs_transformers
def test_greedy_equals_transformers_generate_live(eos_case):
    """transformers' greedy generate on the same directory, with its eos stopping (batch of one)."""
    import torch
    prompt, _, _, eos = eos_case
    for model_dir in (gen_model_dir(), gen_model_dir(eos=eos)):
        hf = hf_model(model_dir)
        llm = LLM(model_dir, backend="numpy", max_context=MAX_CONTEXT)
        for p in [prompt] + prompts(hf.config.vocab_size, lengths=(1, 13), seed=5):
            ids = torch.tensor([p])
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=16, pad_token_id=0)
            [result] = llm.generate([p], SamplingParams(max_new_tokens=16))
            assert result.token_ids == out[0, len(p):].tolist()


def test_stopping_a_stream_early_keeps_the_session_consistent(model):
    """Ctrl-C in the chat closes the generator mid-answer; the next turn must still be exact."""
    params = SamplingParams(max_new_tokens=10, **GREEDY)
    session = ChatSession(model)
    p1 = prompts(model.config.vocab_size, lengths=(7,), seed=6)[0]
    stream = session.stream(p1, params)
    partial = [next(stream) for _ in range(4)]
    stream.close()
    assert session.cached == p1 + partial[:-1]            # the last yielded token was never fed
    p2 = p1 + partial + [42]
    assert stream_all(session, p2, params) == stream_all(ChatSession(model), p2, params)
