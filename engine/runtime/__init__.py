"""The runtime (chapters 08-15): requests in, tokens out.

  llm.py            engine.LLM, the facade: configuration, submit/generate/stats
  engine_loop.py    the one loop that owns the model, the cache and the scheduler
  model_runner.py   device state of a step: launch (forward + sampling), wait, complete
  scheduler.py      which rows run next (continuous/static batching, chunked prefill, preemption)
  kv_allocator.py   pages (or contiguous slots) of the KV cache: free queue, reference counts, keys
  prefix_cache.py   the keys that name full pages, and the longest cached prefix (chapter 15)
  request.py        request handles (stream, result, cancel) and their outputs
  cuda_graphs.py    decode steps captured as CUDA graphs per batch-size bucket
  sampling_params.py  SamplingParams and the seeded per-step draws
  step_log.py       what each step did (telemetry for plots and stats)
  chat_session.py   chapter 08's single-conversation decode loop over a contiguous cache
  engine_process.py the engine loop in a process of its own, for the HTTP server
"""
