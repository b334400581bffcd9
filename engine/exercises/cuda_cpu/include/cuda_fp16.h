// Stand-in for <cuda_fp16.h> on the CPU executor: engine/exercises/cuda_cpu/cuda_cpu.h, included before the
// kernel, already defines what the exercise kernels use from it.
#pragma once
