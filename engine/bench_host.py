"""`python -m engine.bench_host`: the command keeps its documented name; the code is engine/bench/host.py."""
import sys

from engine.bench.host import main

if __name__ == "__main__":
    sys.exit(main())
