"""Shared pytest fixtures and the decisions made once for the whole run.

- the default model (downloaded and converted once per machine, under a file lock so that parallel
  workers never convert it twice) and the tiny chat model of the serving tests (written once per run);
- whether a GPU is usable: `@pytest.mark.gpu` tests skip here, with engine.backend's reason, when it
  is not (`@pytest.mark.gpu(tensor_cores=True)`: also below sm_80), and `@pytest.mark.nogpu` tests (the
  CPU-only messages and fallbacks) skip where it is;
- under pytest-xdist (`-n`), each worker's share of the cores for NumPy's BLAS threads.
"""
import functools
import os
import sys

# Parallel workers: give each its share of the cores for BLAS (and the notebook kernels it starts,
# which inherit the environment) instead of every worker running one thread per core. Set before
# NumPy is imported; an explicit setting wins.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, _threads)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI replays the same examples every run (a landing must not hinge on a lucky draw); locally,
# hypothesis keeps exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

sys.path.insert(0, os.path.dirname(__file__))

try:
    from helpers.default_model import default_gguf_path, default_model_dir  # noqa: F401
except ImportError as exc:  # a bare GPU box without the package's dependencies (gguf) runs test_gpu.py only
    print(f"conftest: default-model fixtures unavailable ({exc})", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# GPU or not: decided here, once per test process

@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when CuPy can run kernels here, else why not (engine.backend.cupy_unavailable_reason)."""
    from engine.backend import cupy_unavailable_reason
    return cupy_unavailable_reason()


@functools.cache
def tensor_cores_missing_reason() -> str | None:
    """None on an sm_80+ GPU (bf16 mma.sync: the GEMV and flash-attention kernels), else why not."""
    import cupy

    from engine.backend import tensor_cores_usable
    device = cupy.cuda.Device()
    if tensor_cores_usable(device.id):
        return None
    return f"needs an sm_80+ GPU (bf16 mma.sync); this one is sm_{device.compute_capability}"


def pytest_collection_modifyitems(config, items):
    # The notebooks first: they are the longest tests of the run (up to minutes each), so under
    # `-n` they start at once while the other workers take the short tests and steal the rest
    # (--dist worksteal); last, one of them would keep a single worker busy after all others finish.
    items.sort(key=lambda item: item.get_closest_marker("notebook") is None)   # stable: else in order
    for item in items:
        gpu = item.get_closest_marker("gpu")
        if gpu is not None:
            reason = gpu_unavailable_reason()
            if reason is None and gpu.kwargs.get("tensor_cores"):
                reason = tensor_cores_missing_reason()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
        if item.get_closest_marker("nogpu") is not None and gpu_unavailable_reason() is None:
            item.add_marker(pytest.mark.skip(reason="a GPU is usable here (the test checks a machine without one)"))


# ---------------------------------------------------------------------------------------------
# Shared fixtures

@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    """tests/helpers/serve.py's tiny chat model (random weights, Llama 3's tokenizer); read-only."""
    from helpers.serve import write_tiny_chat_model
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def both_schedulings(request):
    """Run a module's tests with the engine loop scheduling one step at a time, then again with async
    scheduling (which the engine turns on only on a GPU: here the CPU runs the same overlapped loop).
    Module fixtures that build an LLM must depend on this one."""
    import engine.runtime.engine_config
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine.runtime.engine_config, "default_async_scheduling", lambda backend, scheduler_cls: request.param)
        yield request.param
