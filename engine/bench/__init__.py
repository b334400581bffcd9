"""`python -m engine.bench` and the other measurements: serving scenarios, kernels, host overhead,
the tokenizer, per-kernel step profiles.
"""
