"""How adapter tensors travel between Ray actors: one flat byte buffer plus a table of contents.

Sending 500 separate tensors through Ray pickles each one; packing them into a single buffer makes
the push one copy on each side:

- ``host``: the buffer is a numpy ``uint8`` array. Ray keeps numpy arrays out of band, so the object
  store holds the bytes once and the receiver reads them in place before its single copy to its device.
- ``cuda_ipc``: the buffer stays on the sender's GPU and only a CUDA IPC handle travels (a few hundred
  bytes). Valid only between processes that see the same GPU (colocated placement). The sender must
  keep the buffer alive until every receiver has copied it (the learner keeps its latest export).
- ``collective``: only the table of contents travels through Ray; the bytes follow in one broadcast
  over a ``shared.collective.AdapterChannel`` (NCCL GPU to GPU in split placement).
"""
from __future__ import annotations

from dataclasses import dataclass

ROUTES = ("host", "cuda_ipc", "collective")
ALIGN = 64  # bytes: every tensor starts aligned, so a byte slice can be viewed as any dtype


@dataclass
class PackedTensors:
    """A dict of tensors as one buffer; ``unpack_tensors`` turns it back into the dict."""

    route: str
    entries: list  # (name, dtype name, shape, byte offset, byte count), in the original order
    payload: object  # host: numpy uint8 array; cuda_ipc: (rebuild function, args) from torch; collective: None
    nbytes: int

    def __len__(self) -> int:  # keeps ``if not update.tensors`` meaning "no tensors"
        return len(self.entries)

    def __getstate__(self):  # the sender's own buffer reference (cuda_ipc) never travels
        return {k: v for k, v in self.__dict__.items() if k != "_keepalive"}


def _layout(tensors: dict) -> tuple[list, int]:
    import torch

    entries, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r}: expected a torch.Tensor, found {type(t).__name__}")
        nbytes = t.numel() * t.element_size()
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def pack_tensors(tensors: dict, route: str) -> PackedTensors:
    """One buffer holding every tensor (a copy: later changes to ``tensors`` do not reach it)."""
    import torch

    if route not in ROUTES:
        raise ValueError(f"tensor route: expected one of {ROUTES}, found {route!r}")
    entries, total = _layout(tensors)
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    if route == "cuda_ipc" and device.type != "cuda":
        raise ValueError(f"tensor route cuda_ipc needs CUDA tensors, found them on {device}")
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    for (name, _, _, offset, nbytes), t in zip(entries, tensors.values()):
        buf[offset : offset + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    if route == "host":
        return PackedTensors(route, entries, buf.cpu().numpy(), total)
    if route == "collective":
        packed = PackedTensors(route, entries, None, total)
    else:
        from torch.multiprocessing.reductions import reduce_tensor

        packed = PackedTensors(route, entries, reduce_tensor(buf), total)
    packed._keepalive = buf
    return packed


def sender_buffer(packed: PackedTensors):
    """The sender's own buffer behind a ``cuda_ipc`` or ``collective`` export (what a broadcast sends)."""
    buf = getattr(packed, "_keepalive", None)
    if buf is None:
        raise ValueError("packed tensors: no sender buffer here (only the exporting process has it)")
    return buf


def unpack_tensors(packed: PackedTensors, device, receive=None) -> dict:
    """The tensors, on ``device``, in storage of their own (never the sender's or the object store's).

    ``receive(buf)`` fills a fresh buffer for the ``collective`` route (the channel's broadcast).
    """
    import warnings

    import torch

    if packed.route == "host":
        with warnings.catch_warnings():  # Ray hands out read-only views of its store; we copy at once
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(packed.payload)
        buf = src.to(device, copy=True)
    elif packed.route == "collective":
        if receive is None:
            raise ValueError("packed tensors: the collective route needs a channel to receive on")
        buf = torch.empty(packed.nbytes, dtype=torch.uint8, device=device)
        receive(buf)
    elif packed.route == "cuda_ipc":
        rebuild, args = packed.payload
        shared = rebuild(*args)
        buf = shared.to(device, copy=True)
        del shared  # release the sender's memory as soon as it is copied
    else:
        raise ValueError(f"tensor route: expected one of {ROUTES}, found {packed.route!r}")
    if buf.numel() != packed.nbytes:
        raise ValueError(f"packed tensors: expected {packed.nbytes} bytes, found {buf.numel()}")
    out = {}
    for name, dtype, shape, offset, nbytes in packed.entries:
        out[name] = buf[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)
    return out


def as_tensor_dict(tensors, device, receive=None) -> dict:
    """``tensors`` as a plain dict on ``device``: unpacks a ``PackedTensors``, passes a dict through."""
    return unpack_tensors(tensors, device, receive) if isinstance(tensors, PackedTensors) else tensors
