"""engine: an LLM inference engine built chapter by chapter.

The public contract (see README): ensure_default_model, load_tokenizer, load_model, LLM,
SamplingParams and the `engine.formats.safetensors` module, plus the typed errors a caller may catch:
SafetensorsError, ConfigError, GGUFConversionError, DefaultModelError (all ValueError or
RuntimeError subclasses naming the problem) and BackendError. `__all__` is built from the table
below, so this list and the exports cannot drift apart. Imports are lazy so that `import engine`
stays instant and never touches CuPy.
"""
from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "ensure_default_model": ("engine.model.default_model", "ensure_default_model"),
    "load_tokenizer": ("engine.text.tokenizer", "load_tokenizer"),
    "load_model": ("engine.model.forward_pass", "load_model"),
    "LLM": ("engine.runtime.llm", "LLM"),
    "SamplingParams": ("engine.runtime.sampling_params", "SamplingParams"),
    "SafetensorsError": ("engine.formats.safetensors", "SafetensorsError"),
    "ConfigError": ("engine.formats.config", "ConfigError"),
    "DefaultModelError": ("engine.model.default_model", "DefaultModelError"),
    "GGUFConversionError": ("engine.formats.gguf_convert", "GGUFConversionError"),
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
        return import_module("engine.formats.safetensors")
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
