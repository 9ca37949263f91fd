"""The learner as a Ray actor: ``shared.actors.remote(LearnerActor).options(...).remote(cfg, spec, device)``.

A plain class here (importing this module imports neither Ray nor torch); placement makes it remote.
"""
from __future__ import annotations


class LearnerActor:
    """A ``learner.learner.Learner`` in the actor's process, behind plain methods (Ray has no properties)."""

    def __init__(self, cfg, spec, device: str = "cpu"):
        from nla_grpo.learner.learner import Learner
        from nla_grpo.shared.weight_sync import make_sender

        from nla_grpo.shared.collective import DataParallel

        self.learner = Learner(cfg, spec, device, DataParallel(cfg.placement.collective_timeout_s))
        # this process starts from an arbitrary RNG state (Ray seeds its workers at random): seed it, so the
        # stream a checkpoint saves and a resume restores is the same in a straight run and a resumed one
        import torch

        torch.manual_seed(cfg.seed)
        self.sender = make_sender(cfg.weight_sync, device)  # owns each export's buffer (shared.weight_sync)
        self.gpu_memory()  # the loading's cached blocks go back to the GPU

    def update(self, samples, advantages, vectors) -> dict:
        return self.learner.update(samples, advantages, vectors)

    def planned_tokens(self) -> tuple[int | None, int | None]:
        return self.learner.planned_tokens()

    def gpu_memory(self) -> dict[str, int] | None:
        """What this process's torch holds on its GPU (``shared.torch_utils.settle_cuda_memory``); None on the CPU."""
        from nla_grpo.shared.torch_utils import settle_cuda_memory

        return settle_cuda_memory()

    def logprobs(self, samples, vectors, adapter: str = "default") -> list[list[float]]:
        return self.learner.logprobs(samples, vectors, adapter)

    # ---- weight sync: the sender's half (orchestrator.weight_push drives it) ----
    def weight_sync_rendezvous(self, world_size: int):
        return self.sender.rendezvous(world_size)

    def connect_weight_sync(self, rendezvous) -> None:
        self.sender.connect(rendezvous)

    def export_adapter(self):
        """The current adapter as a ``shared.weight_sync.AdapterMessage`` for every engine."""
        return self.sender.export(self.learner.export_adapter(device="live"))

    def release_export(self, version: int) -> None:
        """Every engine loaded adapter ``version``: the sender's buffer goes. Taking the loaded version makes Ray run
        this only once every load returned."""
        self.sender.release()

    def send_adapter(self, message) -> None:
        """The bytes of ``message`` where they travel apart from it (broadcast). Taking the message as an
        argument makes Ray skip this call when the export failed, so no stale buffer is ever sent."""
        self.sender.send(message)

    def save(self, directory: str, reference: str | None = None) -> str:
        return str(self.learner.save(directory, reference))

    def save_reference(self, directory: str) -> str:
        return str(self.learner.save_reference(directory))

    def load(self, directory: str) -> int:
        """Returns the restored step."""
        self.learner.load(directory)
        return self.learner.step

    def version(self) -> int:
        return self.learner.version

    def checksum(self) -> list[float]:
        return self.learner.checksum()

    # ---- data-parallel ranks (orchestrator.groups joins them) ----
    def data_parallel_rendezvous(self, world_size: int):
        return self.learner.dp.serve(world_size)

    def join_data_parallel(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        self.learner.dp.join(host, port, rank, world_size, backend)
