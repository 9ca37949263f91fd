"""Ray actor classes built on first use, so importing a service module never imports Ray."""
from __future__ import annotations


def lazy_actor_getattr(module_name: str, module_globals: dict, actor_name: str, body: type):
    """A module ``__getattr__`` that turns ``body`` into ``ray.remote(body)`` the first time
    ``actor_name`` is looked up (``from rollout.actor import RolloutActor``), then caches it."""

    def __getattr__(name: str):
        if name == actor_name:
            import ray

            actor = ray.remote(body)
            module_globals[actor_name] = actor
            return actor
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__
