"""Sizes from the checkpoint's config and file sizes: a copy of the base in a precision or in NF4, a LoRA's
parameters. The engine plan counts its weights with them, and ``orchestrator.memory_budget`` what the learner and
the critic hold beside a colocated engine.
"""
from __future__ import annotations

import json

NF4_SHARE = 0.35  # of the bf16 checkpoint: 4-bit linears, their scales, and the embeddings and head kept in 16 bits


def stored_config(cfg) -> dict:
    """The subject model's ``config.json`` as stored (its quantisation, a multimodal checkpoint's parts)."""
    from rollout.vllm_engine import model_dir

    return json.loads((model_dir(cfg) / "config.json").read_text())


def checkpoint_config(cfg) -> dict:
    """The subject model's text config (a multimodal checkpoint's text part)."""
    c = stored_config(cfg)
    return c.get("text_config", c)


def bf16_bytes(cfg) -> int:
    """The checkpoint's weights at two bytes each, whatever precision its files hold (a checkpoint saved in NF4
    holds ``NF4_SHARE`` of that)."""
    from rollout.vllm_engine import model_dir

    files = sum(f.stat().st_size for f in model_dir(cfg).glob("*.safetensors"))
    c = stored_config(cfg)
    if c.get("quantization_config"):
        return int(files / NF4_SHARE)
    c = c.get("text_config", c)
    stored = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    return int(files // 2) if stored.removeprefix("torch.") == "float32" else files


def base_bytes(cfg, elem: int, quantised: bool) -> int:
    """A copy of the base held in ``elem``-byte weights, or quantised to 4 bits."""
    return int(bf16_bytes(cfg) * (NF4_SHARE if quantised else elem / 2))


def lora_params(cfg, rank: int, targets: list[str], blocks: int | None = None) -> int:
    """Parameters of a rank-``rank`` LoRA on ``targets`` in ``blocks`` decoder blocks (all where None)."""
    c = checkpoint_config(cfg)
    hidden, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    sides = {"q_proj": hidden + q, "k_proj": hidden + kv, "v_proj": hidden + kv, "o_proj": q + hidden,
             "gate_proj": hidden + inter, "up_proj": hidden + inter, "down_proj": inter + hidden}
    return rank * sum(sides.get(t, 0) for t in targets) * (c["num_hidden_layers"] if blocks is None else blocks)
