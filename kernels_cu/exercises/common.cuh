// kernels_cu/common.cuh, for a plain `nvcc kernels_cu/exercises/<name>.cu`: nvcc looks for a quoted
// include beside the file first. The engine and the checkers compile with -I kernels_cu, which finds
// the real one directly.
#include "../common.cuh"
