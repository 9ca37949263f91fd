"""The SFT stages' Ray actors: ``shared.actors.remote(AvSftActor).options(...).remote(cfg, spec, device)``.
Plain classes (importing this module imports neither Ray nor torch); ``orchestrator.groups.RankGroup``
drives N of them as data-parallel ranks."""
from __future__ import annotations


class _Ranked:
    def data_parallel_rendezvous(self, world_size: int):
        return self.trainer.dp.serve(world_size)

    def join_data_parallel(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        self.trainer.dp.join(host, port, rank, world_size, backend)

    def checksum(self) -> list[float]:
        return self.trainer.checksum()


class AvSftActor(_Ranked):
    """A ``sft.av.AvSftLearner`` in the actor's process."""

    def __init__(self, cfg, spec, device: str = "cpu"):
        import torch

        from nla_grpo.sft.av import AvSftLearner
        from nla_grpo.shared.collective import DataParallel

        self.trainer = AvSftLearner(cfg, spec, device, DataParallel(cfg.placement.collective_timeout_s))
        torch.manual_seed(cfg.seed)  # Ray seeds its workers at random

    def sft_step(self, prompts, sites, responses, vectors, lr: float) -> dict:
        return self.trainer.sft_step(prompts, sites, responses, vectors, lr)

    def evaluate(self, prompts, sites, responses, vectors) -> dict:
        return self.trainer.nll(prompts, sites, responses, vectors)

    def save(self, directory: str) -> str:
        return str(self.trainer.save(directory))

    def load(self, directory: str) -> int:
        self.trainer.load(directory)
        return self.trainer.step

    def export(self, directory: str) -> str:
        return self.trainer.save_adapter_dir(directory)


class ArSftActor(_Ranked):
    """A ``sft.ar.ArSftCritic`` in the actor's process."""

    def __init__(self, cfg, spec, device: str = "cpu"):
        import torch

        from nla_grpo.sft.ar import ArSftCritic
        from nla_grpo.shared.collective import DataParallel

        torch.manual_seed(cfg.seed)
        self.trainer = ArSftCritic(cfg, spec, device, DataParallel(cfg.placement.collective_timeout_s))

    def sft_step(self, explanations, activations, lr: float) -> dict:
        return self.trainer.sft_step(explanations, activations, lr)

    def evaluate(self, explanations, activations) -> dict:
        return self.trainer.mse(explanations, activations)

    def save(self, directory: str) -> str:
        self.trainer.save(directory, optimizer=True)
        return directory

    def load(self, directory: str) -> int:
        self.trainer.load(directory, require_optimizer=True)
        return 0

    def export(self, directory: str) -> str:
        return self.trainer.save_checkpoint_dir(directory)
