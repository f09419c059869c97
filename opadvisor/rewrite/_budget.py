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

import gc
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

BUDGET_S = 2.0  # CPU seconds per (file, rule): a whole rewrite_source, its stability passes included
# plus this much per source line: each pass visits every node of the file, however simple (a 2,500-line
# transformers model takes 0.4 to 0.9 CPU seconds a pass, two or three passes a rule)
BUDGET_PER_LINE_S = 0.001
BUDGET_ENV = "OPADVISOR_ANALYSIS_BUDGET_S"  # the whole budget, exactly (tests prove the over-budget path)


class OverBudget(Exception):
    """Source analysis ran past its budget; `where` names the function it was reading."""

    def __init__(self, where: str) -> None:
        super().__init__(over_budget_message(where))
        self.where = where

    def __reduce__(self) -> tuple:
        # rebuilt from `where`, not from its message (which __init__ would wrap a second time): the engine
        # keeps a copy of it (engine.rewrite_source)
        return (OverBudget, (self.where,))


def over_budget_message(where: str) -> str:
    """The one line suggest and apply both say."""
    return f"not checked: source analysis over budget (in `{where}`)"


# The budget counts the CPU time of the analysing thread, not the wall clock: on a loaded machine (CI,
# several jobs on few cores) a wall-clock budget would skip fixes at random. It counts the codemods' passes
# over the tree (`start_pass` .. `end_pass`, from the module node's visit to its leave), not parsing and
# libcst's metadata (scopes, qualified names: about a CPU second per thousand lines, however simple the
# code): the budget bounds the analysis, which is what can run away. Reading that clock costs about a
# microsecond, so check() reads it once every CLOCK_EVERY calls.
CLOCK_EVERY = 32


# Nor does it count the garbage collector. A collection runs in whichever thread allocated last and walks
# the whole process's heap: in a long-lived process holding much else (a test worker, a notebook), one full
# collection inside a pass has cost seconds of this thread's CPU time for a fixture whose analysis takes
# 0.05 s, and skipped its fix. gc's callbacks bracket every collection; the thread's CPU time between them
# is kept here per thread and taken off the deadline's clock.
class _CollectorTime(threading.local):
    seconds = 0.0  # CPU seconds this thread has spent in collections since the module was imported
    began: float | None = None


_COLLECTOR = _CollectorTime()


def _time_collections(phase: str, info: dict) -> None:
    if phase == "start":
        _COLLECTOR.began = time.thread_time()
    elif _COLLECTOR.began is not None:
        _COLLECTOR.seconds += time.thread_time() - _COLLECTOR.began
        _COLLECTOR.began = None


# first in the list: at "start" it reads the clock before any callback registered later runs
gc.callbacks.insert(0, _time_collections)


def _analysis_clock() -> float:
    """This thread's CPU time outside garbage collections."""
    return time.thread_time() - _COLLECTOR.seconds


@dataclass
class _Deadline:
    limit: float  # CPU seconds of analysis allowed
    spent: float = 0.0  # in the passes ended so far
    started: float | None = None  # _analysis_clock() when the current pass began
    scopes: list[str] = field(default_factory=list)  # enclosing class/function names, outermost first
    calls: int = 0

    def where(self) -> str:
        return ".".join(self.scopes) or "<module>"

    def used(self) -> float:
        return self.spent + (_analysis_clock() - self.started if self.started is not None else 0.0)


_current: ContextVar[_Deadline | None] = ContextVar("opadvisor_analysis_deadline", default=None)


def budget_seconds(lines: int = 0) -> float:
    """BUDGET_S and BUDGET_PER_LINE_S for a file of `lines` lines, or the environment's override when it
    holds a positive number."""
    default = BUDGET_S + BUDGET_PER_LINE_S * lines
    try:
        value = float(os.environ.get(BUDGET_ENV, ""))
    except ValueError:
        return default
    return value if value > 0 else default


@contextmanager
def analysis_budget(seconds: float | None = None, lines: int = 0) -> Iterator[None]:
    """Run the body under a fresh deadline (an enclosing one is suspended, then restored): `seconds`, or
    the budget of a file of `lines` lines."""
    limit = budget_seconds(lines) if seconds is None else seconds
    token = _current.set(_Deadline(limit))
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
    if deadline.calls % CLOCK_EVERY == 1 and deadline.used() >= deadline.limit:  # the first call reads it
        raise OverBudget(deadline.where())


def start_pass() -> None:
    """A codemod's traversal begins (the module node): its time counts from here."""
    deadline = _current.get()
    if deadline is not None:
        deadline.spent = deadline.used()  # a pass cut short (SkipFile) still counts
        deadline.started = _analysis_clock()
        deadline.scopes.clear()  # and leaves no names behind


def enter(name: str) -> None:
    """A class or function whose code is being analysed from now on (nested: pushed onto the enclosing)."""
    deadline = _current.get()
    if deadline is not None:
        deadline.scopes.append(name)


def end_pass() -> None:
    deadline = _current.get()
    if deadline is not None:
        deadline.spent = deadline.used()
        deadline.started = None


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
