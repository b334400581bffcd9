"""Shared pytest fixtures: the default model (downloaded and converted once per machine)."""
import os
import sys

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
