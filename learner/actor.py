"""The learner as a Ray actor: ``shared.actors.remote(LearnerActor).options(...).remote(cfg, spec, device)``.

A plain class here (importing this module imports neither Ray nor torch); placement makes it remote.
"""
from __future__ import annotations


class LearnerActor:
    """A ``learner.service.Learner`` in the actor's process, behind plain methods (Ray has no properties)."""

    def __init__(self, cfg, spec, device: str = "cpu"):
        from learner.service import Learner

        self.learner = Learner(cfg, spec, device)

    def update(self, samples, advantages, vectors) -> dict:
        return self.learner.update(samples, advantages, vectors)

    def logprobs(self, samples, vectors, adapter: str = "default") -> list[list[float]]:
        return self.learner.logprobs(samples, vectors, adapter)

    def export_adapter(self, route: str = "host"):
        """One packed buffer (``shared.tensor_wire``): host memory, a CUDA IPC handle on a shared GPU,
        or (``collective``) only its table of contents, the bytes following in ``send_adapter``."""
        return self.learner.export_adapter(route=route)

    def serve_channel(self, world_size: int) -> tuple:
        """Rank 0 of the adapter channel (``shared.collective``): returns (host, port) for the engines."""
        from shared.collective import AdapterChannel

        self.channel = AdapterChannel()
        return self.channel.serve(world_size)

    def join_channel(self, host: str, port: int, world_size: int, backend: str) -> None:
        self.channel.join(host, port, 0, world_size, backend)

    def send_adapter(self, export) -> None:
        """Broadcast the ``collective`` export ``export`` (this actor's latest) to every engine.

        Taking the export as an argument makes Ray skip this call when the export failed, so no
        stale buffer is ever sent.
        """
        from shared.tensor_wire import sender_buffer

        if export.version != self.learner.version:
            raise RuntimeError(f"send_adapter: export v{export.version} is not the latest (v{self.learner.version})")
        try:
            self.channel.broadcast(sender_buffer(self.learner._last_export))
        finally:
            self.learner._last_export = None  # every engine has its copy now

    def save(self, directory: str) -> str:
        return str(self.learner.save(directory))

    def load(self, directory: str) -> int:
        """Returns the restored step."""
        self.learner.load(directory)
        return self.learner.step

    def version(self) -> int:
        return self.learner.version
