"""The critic as a Ray actor: ``shared.actors.remote(CriticActor).options(...).remote(cfg, spec, device)``.

A plain class (importing this module stays cheap); the actor builds its ``Critic`` inside its own
process (torch, transformers and peft load there, on the device Ray gave it).
"""
from __future__ import annotations


class CriticActor:
    """Forwards to a ``critic.scoring.Critic`` living in this process."""

    def __init__(self, cfg, spec, device: str = "cpu"):
        from nla_grpo.critic.scoring import Critic

        from nla_grpo.shared.collective import DataParallel

        self.critic = Critic(cfg, spec, device, DataParallel(cfg.placement.collective_timeout_s))
        self.gpu_memory()  # the loading's cached blocks go back to the GPU

    def score(self, explanations, activations):
        return self.critic.score(explanations, activations)

    def score_share(self, explanations, activations):
        return self.critic.score_share(explanations, activations)

    def train_step(self, explanations, activations):
        return self.critic.train_step(explanations, activations)

    def save(self, ckpt_dir, optimizer: bool = True):
        self.critic.save(ckpt_dir, optimizer=optimizer)

    def load(self, ckpt_dir, require_optimizer: bool = False):
        self.critic.load(ckpt_dir, require_optimizer=require_optimizer)

    def describe(self):
        return self.critic.describe()

    def gpu_memory(self) -> dict[str, int] | None:
        """What this process's torch holds on its GPU (``shared.torch_utils.settle_cuda_memory``); None on the CPU."""
        from nla_grpo.shared.torch_utils import settle_cuda_memory

        return settle_cuda_memory()

    def checksum(self):
        return self.critic.checksum()

    # ---- data-parallel ranks (orchestrator.groups joins them) ----
    def data_parallel_rendezvous(self, world_size: int):
        return self.critic.dp.serve(world_size)

    def join_data_parallel(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        self.critic.dp.join(host, port, rank, world_size, backend)
