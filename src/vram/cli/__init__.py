"""The ``vram`` command line (top layer): argument parsing, progress and output for every
subcommand; the work itself is done by the layers below."""
from .commands import main

__all__ = ["main"]
