"""The error types users see, and how any failure becomes one line.

``NlaInputError``: bad user input, a single line naming the file, row or field and what was expected
(exit code 2). It survives pickling, so it crosses Ray from an actor intact. ``one_line(exc)`` is
what the CLI prints for anything else: the innermost cause's type and its own first line, with Ray's
wrapping (task headers, colours, pids) taken off.

``crossing(exc)`` is what an actor raises in place of ``exc``: the innermost cause when it survives
pickling, else a ``ServiceError`` holding that cause's line. Ray replaces an exception it cannot
pickle (vLLM's pydantic ``ValidationError``, anything holding a lock) with one that names only the
type, so without this the cause never reached the user.
"""
from __future__ import annotations

import pickle
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# the last line of Ray's report of a failed constructor names our carrier types with their module
_CARRIER = re.compile(r"^(?:[\w.]*\.)?(?:ServiceError|NlaInputError): ")


class NlaInputError(Exception):
    """Bad user input (config, parquet, sidecar, tokenizer). The CLI prints it as one line, exit 2."""

    def __init__(self, where: str, problem: str):
        self.where = str(where)
        self.problem = problem
        # several problems (a config breaking several rules): one line each, each naming where
        super().__init__("\n".join(f"{self.where}: {line}" for line in problem.splitlines() or [""]))

    def __reduce__(self):  # Exception pickles its message alone; this type needs both parts back
        return type(self), (self.where, self.problem)


class ServiceError(Exception):
    """A failure inside a service carried across Ray as its cause's one line (``Type: text``), for a cause
    that does not survive pickling (its one argument, the line, pickles)."""


def innermost(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s causes: through Ray's task errors (``.cause``) and explicit
    chains (``raise ... from``). An implicit context (an error raised while another was being handled, as
    in ``except KeyError: raise ValueError("helpful")``) is not a cause: the newer error is what its code
    chose to report. It stops at an input error or a carried line, which are already the user's line."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = getattr(exc, "cause", None)
        if not isinstance(nxt, BaseException):
            if isinstance(exc, (NlaInputError, ServiceError)):
                break
            nxt = exc.__cause__
        if nxt is None:
            break
        exc = nxt
    return exc


def first_line(text: str, limit: int = 300) -> str:
    lines = [l.strip() for l in _ANSI.sub("", str(text)).splitlines() if l.strip()]
    return (lines[0] if lines else "")[:limit]


def describe(exc: BaseException) -> str:
    """``Type: text`` of ``exc`` itself in one line. A pydantic ``ValidationError`` (a header line, the
    errors below it) gives its title and each error's message."""
    text = first_line(exc)
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ == "ValidationError" and callable(errors):
        try:
            msgs = [first_line(e.get("msg", "")) for e in errors()]
        except Exception:  # noqa: BLE001 - the first line stays the description
            msgs = []
        if msgs:
            text = first_line(f"{getattr(exc, 'title', '') or text}: {'; '.join(msgs)}")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """``Type: message`` of the innermost cause (an input error, or a cause carried across Ray: its own line)."""
    inner = innermost(exc)
    if isinstance(inner, (NlaInputError, ServiceError)):
        return str(inner)
    return describe(inner)


def crossing(exc: BaseException) -> BaseException:
    """What an actor raises for ``exc`` so that Ray delivers its cause: the innermost exception if it
    pickles and unpickles, else a ``ServiceError`` with that exception's line."""
    inner = innermost(exc)
    try:
        pickle.loads(pickle.dumps(inner))
    except Exception:  # noqa: BLE001 - whatever stops pickling, the line still crosses
        return ServiceError(describe(inner))
    return inner


def actor_death(exc: BaseException) -> str:
    """Why a Ray actor is gone, in one line: for an actor whose constructor raised, that error's own line
    (the last line of Ray's report); otherwise the report's first line."""
    text = _ANSI.sub("", str(getattr(exc, "error_msg", "") or exc))
    if getattr(exc, "actor_init_failed", False):
        lines = [l.strip() for l in text.splitlines() if l.strip()]
        return f"it failed to start: {_CARRIER.sub('', lines[-1])[:300]}" if lines else "it failed to start"
    return first_line(text)


def actor_class(exc: BaseException) -> str | None:
    """The class of the actor a Ray actor error is about, where Ray's report names it (``ray::Class.method``)."""
    found = re.search(r"ray::(\w+)\.", _ANSI.sub("", str(getattr(exc, "error_msg", "") or exc)))
    return found.group(1) if found else None
