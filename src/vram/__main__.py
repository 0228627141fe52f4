"""``python -m vram`` is the ``vram`` command."""
import sys

from .cli import main

sys.exit(main())
