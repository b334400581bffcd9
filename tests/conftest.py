"""Shared pytest fixtures: the default model (downloaded and converted once per machine)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from default_model_fixtures import default_gguf_path, default_model_dir  # noqa: E402,F401
