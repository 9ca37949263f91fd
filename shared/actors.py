"""Ray actor classes are plain classes (``LearnerActor``, ``RolloutActor``, ``CriticActor``) made
remote where they are placed, so importing a service module never imports Ray.

An exception raised inside an actor crosses Ray pickled, and pickling keeps an exception's own
message but drops its chain (``__cause__``): a "No space left on device" under a wrapper would be
lost, and an exception that cannot be pickled at all arrives as Ray's "isn't serializable". So each
public method of an actor made here raises ``shared.errors.crossing`` of what it raised (the innermost
cause, or its line), and the constructor raises its input error or the cause's one line.
"""
from __future__ import annotations

import functools

_REMOTE: dict[type, object] = {}


def _raising_the_cause(method, constructor: bool = False):
    """``constructor``: Ray keeps only the text of a failed constructor's error, whose last line the
    user sees, so it always raises the cause's one line (a multi-line message would show its end)."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            from nla_grpo.shared.errors import NlaInputError, ServiceError, crossing, describe, innermost

            if constructor:
                inner = innermost(exc)
                carried = inner if isinstance(inner, (NlaInputError, ServiceError)) else ServiceError(describe(inner))
            else:
                carried = crossing(exc)
            if carried is exc:
                raise
            # pickling drops __cause__, so the carried error crosses alone; the chain stays in the actor's
            # own report (its log, and the text Ray keeps of a failed constructor), ending with its line
            raise carried from exc

    return call


def remote(body: type):
    """``ray.remote(body)``, built once per class: ``remote(LearnerActor).options(...).remote(...)``."""
    if body not in _REMOTE:
        import ray

        methods = {name: _raising_the_cause(fn) for name, fn in vars(body).items()
                   if callable(fn) and not name.startswith("_")}
        for base in body.__mro__[1:-1]:  # inherited public methods too (test stand-ins subclass the actors)
            for name, fn in vars(base).items():
                if callable(fn) and not name.startswith("_") and name not in methods and name not in vars(body):
                    methods[name] = _raising_the_cause(fn)
        if body.__init__ is not object.__init__:  # a failed start reaches the user by its cause too
            methods["__init__"] = _raising_the_cause(body.__init__, constructor=True)
        _REMOTE[body] = ray.remote(type(body.__name__, (body,), {**methods, "__module__": body.__module__,
                                                                  "__qualname__": body.__qualname__}))
    return _REMOTE[body]
