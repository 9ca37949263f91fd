"""The learner as a Ray actor.

``LearnerActor`` is built lazily (module ``__getattr__``) so importing this module does not import
Ray or torch: ``LearnerActor.options(num_cpus=..., num_gpus=...).remote(cfg, spec, device)``.
"""
from __future__ import annotations

from shared.actors import lazy_actor_getattr


class LearnerService:
    """The actor body: a ``learner.service.Learner`` behind plain methods (Ray has no properties)."""

    def __init__(self, cfg, spec, device: str = "cpu"):
        from learner.service import Learner

        self.learner = Learner(cfg, spec, device)

    def update(self, samples, advantages, vectors) -> dict:
        return self.learner.update(samples, advantages, vectors)

    def logprobs(self, samples, vectors, adapter: str = "default") -> list[list[float]]:
        return self.learner.logprobs(samples, vectors, adapter)

    def export_adapter(self, route: str = "host"):
        """One packed buffer (``shared.tensor_wire``): host memory, or a CUDA IPC handle on a shared GPU."""
        return self.learner.export_adapter(route=route)

    def save(self, directory: str) -> str:
        return str(self.learner.save(directory))

    def load(self, directory: str) -> int:
        """Returns the restored step."""
        self.learner.load(directory)
        return self.learner.step

    def version(self) -> int:
        return self.learner.version


__getattr__ = lazy_actor_getattr(__name__, globals(), "LearnerActor", LearnerService)
