"""The one reader of a model directory's facts: its ``config.json`` (the text part of a multimodal checkpoint), the
quantisation it was saved in, its HF config object, and the sizes that follow from them (a copy of the weights in a
precision or in NF4, a LoRA's parameters). Every service, check and plan asks here; nothing else opens the file.
No weights are read.
"""
from __future__ import annotations

import json
from pathlib import Path

NF4_SHARE = 0.35  # of the bf16 checkpoint: 4-bit linears, their scales, and the embeddings and head kept in 16 bits


def stored_config(model_dir) -> dict:
    """``config.json`` as stored (its quantisation, a multimodal checkpoint's parts); {} where there is none."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def text_config(model_dir) -> dict:
    """The language model's part of ``config.json`` (a multimodal checkpoint's ``text_config``; else the whole)."""
    c = stored_config(model_dir)
    return c.get("text_config") or c


def field(model_dir, key: str):
    """A field of ``config.json``, at its top level or in its ``text_config``; None where absent."""
    c = stored_config(model_dir)
    return c.get(key) or (c.get("text_config") or {}).get(key)


def architectures(model_dir) -> list[str]:
    return list(stored_config(model_dir).get("architectures") or [])


def tied_embeddings(model_dir) -> bool:
    c = stored_config(model_dir)
    return bool(c.get("tie_word_embeddings", (c.get("text_config") or {}).get("tie_word_embeddings", False)))


def saved_quantization(model_dir) -> dict | None:
    """The ``quantization_config`` of a checkpoint saved quantised, as stored; None for one saved in a precision (or
    an unreadable ``config.json``, which is reported where the model is first read)."""
    try:
        return stored_config(model_dir).get("quantization_config") or None
    except (OSError, ValueError, AttributeError):
        return None


def hf_config(model_dir):
    """transformers' config object of the model."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def bf16_bytes(model_dir) -> int:
    """The checkpoint's weights at two bytes each, whatever precision its files hold (a checkpoint saved in NF4
    holds ``NF4_SHARE`` of that)."""
    files = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    if saved_quantization(model_dir):
        return int(files / NF4_SHARE)
    c = text_config(model_dir)
    stored = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    return int(files // 2) if stored.removeprefix("torch.") == "float32" else files


def base_bytes(model_dir, elem: int, quantised: bool) -> int:
    """A copy of the base held in ``elem``-byte weights, or quantised to 4 bits."""
    return int(bf16_bytes(model_dir) * (NF4_SHARE if quantised else elem / 2))


def lora_params(model_dir, rank: int, targets: list[str], blocks: int | None = None) -> int:
    """Parameters of a rank-``rank`` LoRA on ``targets`` in ``blocks`` decoder blocks (all where None)."""
    c = text_config(model_dir)
    hidden, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    sides = {"q_proj": hidden + q, "k_proj": hidden + kv, "v_proj": hidden + kv, "o_proj": q + hidden,
             "gate_proj": hidden + inter, "up_proj": hidden + inter, "down_proj": inter + hidden}
    return rank * sum(sides.get(t, 0) for t in targets) * (c["num_hidden_layers"] if blocks is None else blocks)
