"""engine: an LLM inference engine built chapter by chapter.

The public contract (see README): ensure_default_model, load_tokenizer, load_model, LLM,
SamplingParams and the `engine.safetensors` module, plus the typed errors a caller may catch:
SafetensorsError, ConfigError, GGUFConversionError, DefaultModelError (all ValueError or
RuntimeError subclasses naming the problem) and BackendError. `__all__` is built from the table
below, so this list and the exports cannot drift apart. Imports are lazy so that `import engine`
stays instant and never touches CuPy.
"""
from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "ensure_default_model": ("engine.default_model", "ensure_default_model"),
    "load_tokenizer": ("engine.tokenizer", "load_tokenizer"),
    "load_model": ("engine.model", "load_model"),
    "LLM": ("engine.llm", "LLM"),
    "SamplingParams": ("engine.sampling", "SamplingParams"),
    "SafetensorsError": ("engine.safetensors", "SafetensorsError"),
    "ConfigError": ("engine.config", "ConfigError"),
    "DefaultModelError": ("engine.default_model", "DefaultModelError"),
    "GGUFConversionError": ("engine.gguf_convert", "GGUFConversionError"),
    "BackendError": ("engine.backend", "BackendError"),
    "use_stage": ("engine.plugins", "use_stage"),
    "use_stages": ("engine.plugins", "use_stages"),
}

__all__ = sorted(_LAZY) + ["safetensors"]


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(import_module(module), attr)
        globals()[name] = value
        return value
    if name == "safetensors":
        return import_module("engine.safetensors")
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
