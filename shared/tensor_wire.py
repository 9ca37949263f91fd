"""A dict of tensors as one flat byte buffer plus a table of contents (pure layout, no transport).

Sending 500 separate tensors through Ray pickles each one; one buffer makes a push one copy on each
side, whatever carries the bytes (``shared.weight_sync``: host memory, a CUDA IPC handle, a broadcast).
"""
from __future__ import annotations

ALIGN = 64  # bytes: every tensor starts aligned, so a byte slice can be viewed as any dtype


def layout(tensors: dict) -> tuple[list, int]:
    """The table of contents, ``[(name, dtype name, shape, byte offset, byte count)]`` in the dict's
    order, and the buffer size in bytes."""
    import torch

    entries, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r}: expected a torch.Tensor, found {type(t).__name__}")
        nbytes = t.numel() * t.element_size()
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def pack_tensors(tensors: dict):
    """``(entries, buffer)``: every tensor copied into one ``uint8`` buffer on their device (a snapshot:
    later changes to ``tensors`` do not reach it)."""
    import torch

    entries, total = layout(tensors)
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    for (name, _, _, offset, nbytes), t in zip(entries, tensors.values()):
        buf[offset : offset + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return entries, buf


def unpack_tensors(entries: list, buf) -> dict:
    """The tensors as views into ``buf`` (which the caller owns), in the table's order."""
    import torch

    expected = max((offset + nbytes for _, _, _, offset, nbytes in entries), default=0)
    if buf.numel() < expected:
        raise ValueError(f"packed tensors: expected at least {expected} bytes, found {buf.numel()}")
    return {name: buf[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)
            for name, dtype, shape, offset, nbytes in entries}
