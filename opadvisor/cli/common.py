"""What every command shares: turning user errors into one line on stderr and exit code 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from opadvisor.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_FINDINGS = 1  # verify mismatch, apply --check would change, suggest --exit-code with findings
EXIT_USER_ERROR = 2


def fail(message: str) -> typer.Exit:
    """Print `opadvisor: error: message` on stderr; return the Exit(2) for the caller to raise."""
    print(f"opadvisor: error: {message}", file=sys.stderr)
    return typer.Exit(EXIT_USER_ERROR)


def warn(message: str) -> None:
    print(f"opadvisor: warning: {message}", file=sys.stderr)


def note(message: str) -> None:
    """Something the user should know that is no problem (how a script is run, say), on stderr."""
    print(f"opadvisor: {message}", file=sys.stderr)


def user_errors(fn: F) -> F:
    """Decorator for command functions: a UserError becomes one line on stderr and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            raise fail(str(exc)) from None
        except KeyboardInterrupt:
            raise fail("interrupted") from None

    return wrapper  # type: ignore[return-value]
