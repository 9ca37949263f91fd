"""Small torch helpers every service shares (imported only where torch is needed)."""
from __future__ import annotations

import torch


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """Config dtype name -> torch dtype; 'auto' = bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def make_adamw(params, lr: float, kind: str = "auto"):
    """8-bit AdamW from bitsandbytes where asked for / available (CUDA), torch AdamW otherwise; betas (0.9, 0.95)."""
    params = list(params)
    if kind in ("auto", "adamw8bit") and params and params[0].is_cuda:
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        except ImportError:
            if kind == "adamw8bit":
                raise
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def right_pad(seqs, pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids[B, L], attention_mask[B, L])`` of token lists right-padded with ``pad_id`` (causal
    attention never sees the padding after a row's last real token)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[row, : len(s)] = 1
    return ids.to(device), mask.to(device)
