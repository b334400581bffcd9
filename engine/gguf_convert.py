"""`python -m engine.gguf_convert`: the command keeps its documented name; the code is engine/formats/gguf_convert.py."""
import sys

from engine.formats.gguf_convert import main

if __name__ == "__main__":
    sys.exit(main())
