"""Ray actor classes are plain classes (``LearnerActor``, ``RolloutActor``, ``CriticActor``) made
remote where they are placed, so importing a service module never imports Ray."""
from __future__ import annotations

_REMOTE: dict[type, object] = {}


def remote(body: type):
    """``ray.remote(body)``, built once per class: ``remote(LearnerActor).options(...).remote(...)``."""
    if body not in _REMOTE:
        import ray

        _REMOTE[body] = ray.remote(body)
    return _REMOTE[body]
