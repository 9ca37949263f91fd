"""How the policy adapter travels from the learner to the rollout engines: a sender/receiver pair per
``weight_sync`` variant (``shared.config``), chosen by its ``kind``.

The learner's actor holds the ``WeightSender``: it packs the adapter into one buffer
(``shared.tensor_wire``) and owns that buffer until every receiver has its copy. Each rollout actor
holds a ``WeightReceiver``: it turns a message into an ``AdapterUpdate`` of tensors on its device, in
storage of their own. The controller drives every variant with the same calls
(``orchestrator.weight_push``):

1. once: ``rdv = sender.rendezvous(world_size)``, then at the same time ``sender.connect(rdv)`` and
   ``receiver.connect(rdv, rank)`` for ranks 1..n (a no-op except for ``broadcast``);
2. per push: ``message = sender.export(update)``, then at the same time ``receiver.receive(message,
   device)`` in every engine and ``sender.send(message)`` (the bytes, for ``broadcast`` only).

- ``host``: the bytes as a numpy array in the message; Ray keeps it out of band (one copy in the
  object store, read in place by the receiver before its one copy to its device).
- ``cuda_ipc``: a CUDA IPC handle to the sender's GPU buffer (a few hundred bytes); one GPU shared by
  all (colocated). The sender keeps the buffer until its next export.
- ``broadcast``: only the table of contents in the message; the bytes follow in one broadcast over a
  ``shared.collective.AdapterChannel`` (NCCL GPU to GPU, gloo on the CPU). The sender frees the
  buffer once the broadcast is done.
- ``file``: as ``host``; the engine then registers the adapter from a PEFT directory
  (``rollout.vllm.adapter_registry.FileRegistry``) instead of in memory.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from nla_grpo.shared.types import AdapterUpdate


@dataclass
class AdapterMessage:
    """What one push sends through Ray: version, PEFT config, the buffer's table of contents, and the
    bytes (``host``), a CUDA IPC handle (``cuda_ipc``) or nothing (``broadcast``)."""

    kind: str
    version: int
    peft_config: dict
    entries: list  # shared.tensor_wire.layout
    nbytes: int
    payload: object = None


class WeightSender(ABC):
    """The learner's half: export packs, ``send`` completes the transfer where the bytes go separately."""

    kind = ""

    def __init__(self, settings=None, device: str = "cpu"):
        self.settings, self.device = settings, device
        self._buffer = None  # the latest export's buffer, while receivers may still read it
        self._version = None

    def rendezvous(self, world_size: int):
        """Where the receivers meet the sender (``broadcast``); None for the others."""
        return None

    def connect(self, rendezvous) -> None:
        """Join the group the receivers join (``broadcast``); nothing to do for the others."""

    def export(self, update: AdapterUpdate) -> AdapterMessage:
        """Pack ``update`` (a snapshot: later training does not reach it); the previous buffer goes."""
        from nla_grpo.shared.tensor_wire import pack_tensors

        if not update.tensors:
            raise ValueError(f"adapter version {update.version} has no tensors")
        self._buffer = None  # every receiver copied it before the push that made it returned
        entries, buf = pack_tensors(update.tensors)
        message = AdapterMessage(self.kind, update.version, dict(update.peft_config), entries, buf.numel())
        message.payload = self._payload(buf)
        self._version = update.version
        return message

    @abstractmethod
    def _payload(self, buf):
        """What travels with the message; keeps ``buf`` in ``self._buffer`` when receivers read it later."""

    def send(self, message: AdapterMessage) -> None:
        """The bytes, for the variants that send them apart from the message (``broadcast``)."""

    def release(self) -> None:
        """Every receiver holds its copy: the export buffer goes (a ``cuda_ipc`` one would otherwise hold the adapter's
        fp32 bytes on the GPU through the next update)."""
        self._buffer = None

    def close(self) -> None:
        self._buffer = None


class WeightReceiver(ABC):
    """An engine's half: a message in, an ``AdapterUpdate`` of tensors on ``device`` out."""

    kind = ""
    forwardable = False  # the message is a handle another process of the engine's GPU can open itself

    def __init__(self, settings=None):
        self.settings = settings

    def connect(self, rendezvous, rank: int) -> None:
        """Join the sender's group as ``rank`` (``broadcast``); nothing to do for the others."""

    def receive(self, message: AdapterMessage, device) -> AdapterUpdate:
        from nla_grpo.shared.tensor_wire import unpack_tensors

        if message.kind != self.kind:
            raise ValueError(f"weight sync: a {message.kind!r} message reached a {self.kind!r} receiver")
        buf = self._fill(message, device)
        if buf.numel() != message.nbytes:
            raise ValueError(f"adapter v{message.version}: expected {message.nbytes} bytes, found {buf.numel()}")
        return AdapterUpdate(message.version, unpack_tensors(message.entries, buf), message.peft_config)

    @abstractmethod
    def _fill(self, message: AdapterMessage, device):
        """A fresh ``uint8`` buffer on ``device`` holding the message's bytes (never the sender's storage)."""


# ---- host (and file) ----------------------------------------------------------------------------
class HostSender(WeightSender):
    kind = "host"

    def _payload(self, buf):
        return buf.cpu().numpy()


class HostReceiver(WeightReceiver):
    kind = "host"

    def _fill(self, message, device):
        import warnings

        import torch

        with warnings.catch_warnings():  # Ray hands out read-only views of its store; we copy at once
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(message.payload)
        return src.to(device, copy=True)


# ---- cuda_ipc -----------------------------------------------------------------------------------
class CudaIpcSender(WeightSender):
    kind = "cuda_ipc"

    def _payload(self, buf):
        from torch.multiprocessing.reductions import reduce_tensor

        if buf.device.type != "cuda":
            raise ValueError(f"weight_sync cuda_ipc needs the adapter on a CUDA device, found it on {buf.device}")
        self._buffer = buf  # the receivers map this memory: it stays until they hold their copies (``release``)
        return reduce_tensor(buf)


class CudaIpcReceiver(WeightReceiver):
    kind = "cuda_ipc"
    forwardable = True

    def _fill(self, message, device):
        rebuild, args = message.payload
        shared = rebuild(*args)
        buf = shared.to(device, copy=True)
        del shared  # release the mapping of the sender's memory as soon as it is copied
        return buf


# ---- broadcast ----------------------------------------------------------------------------------
def _channel(settings):
    from nla_grpo.shared.collective import AdapterChannel

    return AdapterChannel(timeout_s=getattr(settings, "timeout_s", 600.0))


class BroadcastSender(WeightSender):
    kind = "broadcast"

    def rendezvous(self, world_size: int):
        self.channel = _channel(self.settings)
        host, port = self.channel.serve(world_size)
        backend = "nccl" if str(self.device).startswith("cuda") else "gloo"
        return {"host": host, "port": port, "world_size": world_size, "backend": backend}

    def connect(self, rendezvous) -> None:
        self.channel.join(rendezvous["host"], rendezvous["port"], 0, rendezvous["world_size"], rendezvous["backend"])

    def _payload(self, buf):
        self._buffer = buf  # sent by ``send``, then freed
        return None

    def send(self, message: AdapterMessage) -> None:
        if self._buffer is None or message.version != self._version:
            raise RuntimeError(f"weight sync: adapter v{message.version} is not the latest export (v{self._version})")
        try:
            self.channel.broadcast(self._buffer)
        finally:
            self._buffer = None  # every engine has its copy now


class BroadcastReceiver(WeightReceiver):
    kind = "broadcast"

    def connect(self, rendezvous, rank: int) -> None:
        self.channel = _channel(self.settings)
        self.channel.join(rendezvous["host"], rendezvous["port"], rank, rendezvous["world_size"], rendezvous["backend"])

    def _fill(self, message, device):
        import torch

        if getattr(self, "channel", None) is None:
            raise RuntimeError("weight sync broadcast: receiver not connected (connect before the first push)")
        buf = torch.empty(message.nbytes, dtype=torch.uint8, device=device)
        self.channel.broadcast(buf)
        return buf


VARIANTS = {cls.kind: (cls, rec) for cls, rec in (
    (HostSender, HostReceiver), (CudaIpcSender, CudaIpcReceiver), (BroadcastSender, BroadcastReceiver))}
# file: the bytes travel as for host; what differs is how the engine registers them (from a PEFT directory,
# ``rollout.vllm.adapter_registry.FileRegistry``), which the config variant declares (``registers_from_directory``)
VARIANTS["file"] = VARIANTS["host"]


def _variant(settings):
    kind = getattr(settings, "kind", settings)
    if kind not in VARIANTS:
        raise ValueError(f"weight_sync.kind: expected one of {', '.join(VARIANTS)}, found {kind!r} (auto resolves when the config is read)")
    return VARIANTS[kind]


def forwardable(message: AdapterMessage) -> bool:
    """Whether ``message`` may go on, as it is, to an engine core in another process on the same GPU, which opens it
    there (a ``cuda_ipc`` handle), instead of being received here."""
    return message.kind in VARIANTS and VARIANTS[message.kind][1].forwardable


def make_sender(settings, device: str = "cpu") -> WeightSender:
    """The learner's half for a ``weight_sync`` section (or a kind name)."""
    return _variant(settings)[0](settings if not isinstance(settings, str) else None, device)


def make_receiver(settings) -> WeightReceiver:
    """An engine's half for a ``weight_sync`` section (or a kind name)."""
    return _variant(settings)[1](settings if not isinstance(settings, str) else None)
