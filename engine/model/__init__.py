"""The model (chapters 03-08): its weights on the backend, the forward pass over a batch of rows, the
KV cache memory it reads and writes, and the model directories the engine makes (random weights of
a real shape, the converted default model).
"""
