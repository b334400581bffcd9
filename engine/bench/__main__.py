"""`python -m engine.bench`: see engine/bench/run.py."""
import sys

from engine.bench.run import main

sys.exit(main())
