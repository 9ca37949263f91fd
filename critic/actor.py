"""The critic as a Ray actor: ``CriticActor.options(num_cpus=..., num_gpus=...).remote(cfg, spec, device)``.

Ray is imported only when ``CriticActor`` is first looked up, so importing this module stays cheap.
The actor builds its ``CriticService`` inside its own process (torch, transformers and peft load
there, on the device Ray gave it).
"""
from __future__ import annotations


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


_remote_class = None


def __getattr__(name: str):
    # module-level lazy attribute: `from critic.actor import CriticActor` imports ray only then
    global _remote_class
    if name == "CriticActor":
        if _remote_class is None:
            import ray

            _remote_class = ray.remote(CriticWorker)
        return _remote_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
