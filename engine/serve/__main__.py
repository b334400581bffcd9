"""`python -m engine.serve`: see engine/serve/server.py."""
import sys

from engine.serve.server import main

sys.exit(main())
