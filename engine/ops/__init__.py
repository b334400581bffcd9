"""The stages of the forward pass. Each module holds a NumPy reference (`*_ref`, float32, the math
as written in the papers) and a dispatching function that runs the reference on NumPy arrays and
the stage's CUDA C kernel (kernels_cu/<stage>.cu) on CuPy arrays."""
