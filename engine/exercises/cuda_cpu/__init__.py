"""The CPU executor of the chapters' CUDA exercises: engine/exercises/cuda_cpu/executor.py (with
cuda_cpu.h, runtime.cpp and the child process in _child.py)."""
