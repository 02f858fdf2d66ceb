"""The `matrix` command: one module per verb group."""

from matrix.cli.main import main

__all__ = ["main"]
