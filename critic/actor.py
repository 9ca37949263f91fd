"""The critic as a Ray actor: ``CriticActor.options(num_cpus=..., num_gpus=...).remote(cfg, spec, device)``.

Ray is imported only when ``CriticActor`` is first looked up, so importing this module stays cheap.
The actor builds its ``CriticService`` inside its own process (torch, transformers and peft load
there, on the device Ray gave it).
"""
from __future__ import annotations

from shared.actors import lazy_actor_getattr


class CriticWorker:
    """Forwards to a ``CriticService`` living in this process."""

    def __init__(self, cfg, spec, device: str = "cpu"):
        from critic.scoring import CriticService

        self.service = CriticService(cfg, spec, device)

    def score(self, explanations, activations):
        return self.service.score(explanations, activations)

    def train_step(self, explanations, activations):
        return self.service.train_step(explanations, activations)

    def save(self, ckpt_dir, optimizer: bool = True):
        self.service.save(ckpt_dir, optimizer=optimizer)

    def load(self, ckpt_dir, require_optimizer: bool = False):
        self.service.load(ckpt_dir, require_optimizer=require_optimizer)

    def describe(self):
        return self.service.describe()


__getattr__ = lazy_actor_getattr(__name__, globals(), "CriticActor", CriticWorker)
