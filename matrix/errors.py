"""Errors the CLI turns into one line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input (spec, corpus, model path, warehouse). The message is the whole report."""


class OracleError(UserError):
    """A stack's weights were not all loaded from the checkpoint (seed 002: a silently
    random-initialised oracle makes every comparison meaningless)."""
