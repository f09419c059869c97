"""A hard time budget for one codemod's source analysis of one file (one rule, one file).

    with analysis_budget():          # rewrite_source: the dry runs of suggest and every apply
        ...                          # the codemod runs; its loops call check()
    except OverBudget as exc:        # exc.where: the function being analysed, "Class.method"

Matching reads code through temporaries, casts and aliases; a pattern the matchers did not foresee must
cost a finding its fix, never hang `suggest` or `apply`. The checks are cooperative: the codemod's
traversal (`RuleCodemod.on_visit`), every binding lookup and every loop that follows values call
`check()`, which raises `OverBudget` once the deadline has passed. Outside a budget `check()` does nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

BUDGET_S = 2.0  # CPU seconds per (file, rule): a whole rewrite_source, its stability passes included
BUDGET_ENV = "OPADVISOR_ANALYSIS_BUDGET_S"  # overrides BUDGET_S (tests prove the over-budget path with it)


class OverBudget(Exception):
    """Source analysis ran past its budget; `where` names the function it was reading."""

    def __init__(self, where: str) -> None:
        super().__init__(over_budget_message(where))
        self.where = where


def over_budget_message(where: str) -> str:
    """The one line suggest and apply both say."""
    return f"not checked: source analysis over budget (in `{where}`)"


# The budget counts the CPU time of the analysing thread, not the wall clock: on a loaded machine (CI,
# several jobs on few cores) a wall-clock budget would skip fixes at random. Reading that clock costs about
# a microsecond, so check() reads it once every CLOCK_EVERY calls.
CLOCK_EVERY = 32


@dataclass
class _Deadline:
    at: float  # in time.thread_time()
    scopes: list[str] = field(default_factory=list)  # enclosing class/function names, outermost first
    calls: int = 0

    def where(self) -> str:
        return ".".join(self.scopes) or "<module>"


_current: ContextVar[_Deadline | None] = ContextVar("opadvisor_analysis_deadline", default=None)


def budget_seconds() -> float:
    """BUDGET_S, or the environment's override when it holds a positive number."""
    try:
        value = float(os.environ.get(BUDGET_ENV, ""))
    except ValueError:
        return BUDGET_S
    return value if value > 0 else BUDGET_S


@contextmanager
def analysis_budget(seconds: float | None = None) -> Iterator[None]:
    """Run the body under a fresh deadline (an enclosing one is suspended, then restored)."""
    limit = budget_seconds() if seconds is None else seconds
    token = _current.set(_Deadline(time.thread_time() + limit))
    try:
        yield
    finally:
        _current.reset(token)


def check() -> None:
    """Raise OverBudget when the current deadline has passed (nothing outside a budget)."""
    deadline = _current.get()
    if deadline is None:
        return
    deadline.calls += 1
    if deadline.calls % CLOCK_EVERY == 1 and time.thread_time() > deadline.at:  # the first call reads it
        raise OverBudget(deadline.where())


def enter(name: str) -> None:
    """A class or function whose code is being analysed from now on (nested: pushed onto the enclosing)."""
    deadline = _current.get()
    if deadline is not None:
        deadline.scopes.append(name)


def reset_scopes() -> None:
    deadline = _current.get()
    if deadline is not None:
        deadline.scopes.clear()


def leave() -> None:
    deadline = _current.get()
    if deadline is not None and deadline.scopes:
        deadline.scopes.pop()


@contextmanager
def analysing(*names: str) -> Iterator[None]:
    """Name the code analysed inside the body (a scan of a class ahead of the traversal reaching it)."""
    deadline = _current.get()
    saved = None if deadline is None else list(deadline.scopes)
    if deadline is not None:
        deadline.scopes[:] = list(names)
    try:
        yield
    finally:
        if deadline is not None and saved is not None:
            deadline.scopes[:] = saved
