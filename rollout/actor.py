"""The rollout engine as a Ray actor, and the backend choice.

``RolloutActor`` is a plain class (importing this module does not import Ray); placement makes it
remote: ``shared.actors.remote(RolloutActor).options(...).remote(cfg, spec, backend, device)``.
"""
from __future__ import annotations

from nla_grpo.rollout.engine import RolloutEngine
from nla_grpo.shared.types import PromptRequest, Sample

BACKENDS = ("vllm", "hf")


def make_engine(cfg, spec, device: str = "cpu", backend: str | None = None, resident_bytes: int = 0) -> RolloutEngine:
    """The engine ``backend`` names (default: ``cfg.rollout.backend``); ``resident_bytes``: what the learner and critic
    hold beside a colocated vLLM engine on its GPU."""
    backend = backend or cfg.rollout.backend
    if backend == "vllm":
        from nla_grpo.rollout.vllm.engine import VllmEngine

        return VllmEngine(cfg, spec, device, resident_bytes)
    if backend == "hf":
        from nla_grpo.rollout.hf_engine import HfEngine

        return HfEngine(cfg, spec, device)
    raise ValueError(f"rollout backend: expected one of {BACKENDS}, found {backend!r}")


def release_cached_memory() -> None:
    """Give the memory torch's allocator holds unused in this process back to the device (a colocated GPU's other
    processes can use it); nothing where this process never used CUDA."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class RolloutActor:
    """One engine in the actor's process, the RolloutEngine calls as plain methods (Ray has no properties)."""

    def __init__(self, cfg, spec, backend: str | None = None, device: str = "cpu", resident_bytes: int = 0):
        from nla_grpo.shared.weight_sync import make_receiver

        self.engine = make_engine(cfg, spec, device, backend, resident_bytes)
        self.receiver = make_receiver(cfg.weight_sync)  # the engine's half of shared.weight_sync

    def connect_weight_sync(self, rendezvous, rank: int) -> None:
        self.receiver.connect(rendezvous, rank)

    def generate(self, requests: list[PromptRequest], seed: int, ignore_eos: bool = False, inject: bool = True) -> list[Sample]:
        return self.engine.generate(requests, seed, ignore_eos, inject)

    def load_adapter(self, message) -> int:
        """Receive a ``shared.weight_sync.AdapterMessage`` and load it; returns the version now in use
        (lets the controller wait on the push)."""
        if self.receiver.forwardable and getattr(self.engine, "receives_in_worker", False):
            self.engine.load_adapter_message(message)  # the engine core's own process opens the handle
        else:
            self.engine.load_adapter(self.receiver.receive(message, self.engine.device))
        release_cached_memory()  # the received copy is gone now: its memory back to the device, for the learner
        return self.engine.adapter_version

    def adapter_version(self) -> int:
        return self.engine.adapter_version

    def describe(self) -> str:
        return self.engine.describe()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.engine.close()
