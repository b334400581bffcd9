"""Greedy and seeded-sampled tokens of one fixed workload, as JSON on stdout: run it under two trees of
the engine (PYTHONPATH=TREE python3 same_tokens.py MODEL_DIR) and compare the files.

The workload: 64 token-id prompts of 100..500 tokens through LLM.generate (greedy, then temperature 0.8
with top-k 50 / top-p 0.95 and a seed per request), and one prompt through ChatSession (chapter 08's
decode loop, greedy)."""
import hashlib
import json
import sys

import numpy as np

import engine

model_dir = sys.argv[1]
rng = np.random.default_rng(0)
llm = engine.LLM(model_dir, backend="cupy", kv_cache_mib=4096)
vocab = llm.config.vocab_size
prompts = [rng.integers(300, vocab, int(rng.integers(100, 501))).tolist() for _ in range(64)]
greedy = engine.SamplingParams(max_new_tokens=64, ignore_eos=True)
sampled = [engine.SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=0.8, top_k=50, top_p=0.95, seed=i)
           for i in range(64)]
out = {"engine": engine.__file__}
for name, params in (("greedy", greedy), ("sampled", sampled)):
    ids = [r.token_ids for r in llm.generate(prompts, params)]
    out[name] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    out[name + "_first"] = ids[0][:8]
try:
    from engine.runtime.chat_session import ChatSession
except ImportError:                      # the flat layout
    from engine.chat_session import ChatSession
session = ChatSession(llm.model)
ids = list(session.stream(prompts[0], greedy))
out["chat_session"] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
print(json.dumps(out))
