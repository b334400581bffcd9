"""`python -m engine.chat`: see engine/chat/cli.py."""
import sys

from engine.chat.cli import main

sys.exit(main())
