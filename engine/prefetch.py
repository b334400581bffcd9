"""`python -m engine.prefetch`: get a machine ready for a room without internet.

Run it once while the network is there (an instructor before the workshop, a learner at home):

1. fetch and convert the default model into the cache (engine.model.default_model; nothing happens if it
   is already there), and check that it loads and answers;
2. on a GPU machine, warm the kernel compile cache: run the chat's and the server's paths once so
   that NVRTC compiles every kernel they launch for this model's shapes. CuPy keeps the compiled
   kernels on disk (~/.cupy/kernel_cache, or $CUPY_CACHE_DIR), so the room's first answer does not
   wait for the compiler.

After it, nothing the chapters, the chat or the server do needs the network. It prints where the
model lives and how to point the engine at it (ENGINE_CACHE_DIR / ENGINE_MODEL_DIR).

    python -m engine.prefetch [--cache-dir DIR] [--backend auto|numpy|cupy]
"""
from __future__ import annotations

import argparse
import sys
import time

from engine.backend import BACKENDS, resolve_backend
from engine.model.default_model import DefaultModelError, cache_root, ensure_default_model

WARM_PROMPT = "What is the capital of France?"


def warm_up(model_dir, backend) -> dict:
    """Serve one greedy and one sampled request: every kernel of the prefill, decode and sampling
    paths is launched (so compiled, on the GPU) once. Returns what was generated and how long it took."""
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model_dir, backend=backend, max_seqs=2, kv_cache_mib=64)
    assert llm.tokenizer is not None                 # the default model comes with its tokenizer.json
    messages = [{"role": "user", "content": WARM_PROMPT}]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    greedy, sampled = llm.generate([prompt, prompt], [SamplingParams(max_new_tokens=12),
                                                      SamplingParams(max_new_tokens=4, temperature=0.7, seed=0)])
    return {"answer": greedy.text, "sampled_tokens": len(sampled.token_ids), "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=None, help="cache root (default: $ENGINE_CACHE_DIR or ~/.cache/llm-engine)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    args = ap.parse_args(argv)
    try:
        model_dir = ensure_default_model(args.cache_dir)
    except DefaultModelError as exc:
        print(f"prefetch: {exc}", file=sys.stderr)
        return 1
    print(f"[OK] default model     {model_dir}")
    backend = resolve_backend(args.backend)
    result = warm_up(model_dir, backend)
    kernels = "kernels compiled and cached" if backend.is_gpu else "no kernels to compile on the CPU"
    print(f"[OK] {backend.name:<17} answered {result['answer']!r} in {result['seconds']:.1f} s ({kernels})")
    print(f"Ready for offline use. The cache root is {cache_root(args.cache_dir)}; copy it to another machine "
          "and set ENGINE_CACHE_DIR to it, or set ENGINE_MODEL_DIR to the model directory above.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
