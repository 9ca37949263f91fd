"""The critic as a Ray actor: ``shared.actors.remote(CriticActor).options(...).remote(cfg, spec, device)``.

A plain class (importing this module stays cheap); the actor builds its ``Critic`` inside its own
process (torch, transformers and peft load there, on the device Ray gave it).
"""
from __future__ import annotations


class CriticActor:
    """Forwards to a ``critic.scoring.Critic`` living in this process."""

    def __init__(self, cfg, spec, device: str = "cpu"):
        from critic.scoring import Critic

        self.service = Critic(cfg, spec, device)

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
