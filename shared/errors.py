"""The error types users see, and how any failure becomes one line.

``NlaInputError``: bad user input, a single line naming the file, row or field and what was expected
(exit code 2). It survives pickling, so it crosses Ray from an actor intact. ``one_line(exc)`` is
what the CLI prints for anything else: the innermost cause's type and its own first line, with Ray's
wrapping (task headers, colours, pids) taken off.
"""
from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class NlaInputError(Exception):
    """Bad user input (config, parquet, sidecar, tokenizer). The CLI prints it as one line, exit 2."""

    def __init__(self, where: str, problem: str):
        self.where = str(where)
        self.problem = problem
        super().__init__(f"{self.where}: {problem}")

    def __reduce__(self):  # Exception pickles its message alone; this type needs both parts back
        return type(self), (self.where, self.problem)


def innermost(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``: through Ray's task errors (``.cause``) and chained causes."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = getattr(exc, "cause", None)
        if not isinstance(nxt, BaseException):
            nxt = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if nxt is None:
            break
        exc = nxt
    return exc


def first_line(text: str, limit: int = 300) -> str:
    lines = [l.strip() for l in _ANSI.sub("", str(text)).splitlines() if l.strip()]
    return (lines[0] if lines else "")[:limit]


def one_line(exc: BaseException) -> str:
    """``Type: message`` of the innermost cause (an input error: its own line)."""
    inner = innermost(exc)
    if isinstance(inner, NlaInputError):
        return str(inner)
    text = first_line(inner)
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


def actor_death(exc: BaseException) -> str:
    """Why a Ray actor is gone, in one line: for an actor whose constructor raised, that error's own line
    (the last line of Ray's report); otherwise the report's first line."""
    text = _ANSI.sub("", str(getattr(exc, "error_msg", "") or exc))
    if getattr(exc, "actor_init_failed", False):
        lines = [l.strip() for l in text.splitlines() if l.strip()]
        return f"it failed to start: {lines[-1][:300]}" if lines else "it failed to start"
    return first_line(text)
