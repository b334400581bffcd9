"""`python -m engine.kernel_bench`: the command keeps its documented name; the code is engine/bench/kernels.py."""
import sys

from engine.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
