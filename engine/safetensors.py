"""`engine.safetensors`: the public name (load_file, save_file, SafetensorsError) of
engine/formats/safetensors.py. Importing it gives that very module, not a copy: one module object,
whichever name a caller uses."""
import sys

from engine.formats import safetensors as _module

sys.modules[__name__] = _module
