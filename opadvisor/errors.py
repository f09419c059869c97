"""Errors a user can cause. The CLI prints their message on one line to stderr and exits 2."""


class UserError(Exception):
    """A problem with the user's input or environment, reported without a traceback (exit code 2)."""
