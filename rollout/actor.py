"""The rollout engine as a Ray actor, and the backend choice.

``RolloutActor`` is a plain class (importing this module does not import Ray); placement makes it
remote: ``shared.actors.remote(RolloutActor).options(...).remote(cfg, spec, backend, device)``.
"""
from __future__ import annotations

from rollout.engine import RolloutEngine
from shared.types import AdapterUpdate, PromptRequest, Sample

BACKENDS = ("vllm", "hf")


def make_engine(cfg, spec, device: str = "cpu", backend: str | None = None) -> RolloutEngine:
    """The engine ``backend`` names (default: ``cfg.rollout.backend``)."""
    backend = backend or cfg.rollout.backend
    if backend == "vllm":
        from rollout.vllm_engine import VllmEngine

        return VllmEngine(cfg, spec, device)
    if backend == "hf":
        from rollout.hf_engine import HfEngine

        return HfEngine(cfg, spec, device)
    raise ValueError(f"rollout backend: expected one of {BACKENDS}, found {backend!r}")


class RolloutActor:
    """One engine in the actor's process, the RolloutEngine calls as plain methods (Ray has no properties)."""

    def __init__(self, cfg, spec, backend: str | None = None, device: str = "cpu"):
        self.engine = make_engine(cfg, spec, device, backend)
        self.channel = None

    def join_channel(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join the learner's adapter channel (``shared.collective``) as ``rank``."""
        from shared.collective import AdapterChannel

        self.channel = AdapterChannel()
        self.channel.join(host, port, rank, world_size, backend)

    def generate(self, requests: list[PromptRequest], seed: int, ignore_eos: bool = False, inject: bool = True) -> list[Sample]:
        return self.engine.generate(requests, seed, ignore_eos, inject)

    def load_adapter(self, update: AdapterUpdate) -> int:
        """Returns the version now in use (lets the driver wait on the push)."""
        from dataclasses import replace

        from shared.tensor_wire import as_tensor_dict

        receive = self.channel.broadcast if self.channel is not None else None
        self.engine.load_adapter(replace(update, tensors=as_tensor_dict(update.tensors, self.engine.device, receive)))
        return self.engine.adapter_version

    def adapter_version(self) -> int:
        return self.engine.adapter_version

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.engine.close()
