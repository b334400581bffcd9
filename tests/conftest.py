"""Shared pytest fixtures: the default model (downloaded and converted once per machine), the tiny
chat model of the serving tests (written once per run)."""
import os
import sys

import pytest
from hypothesis import settings

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
