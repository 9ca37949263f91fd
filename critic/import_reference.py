"""AR-LoRA directories of the single-process reference trainer -> this project's critic checkpoint.

The reference trainer keeps its AR as ``ar_meta.json`` (``ar_num_layers``, ``lora_r``,
``lora_alpha``, ``target_modules``, optionally ``quant`` and ``final_norm_stripped``) and
``ar_lora_value_head.safetensors``: the LoRA tensors of its truncated backbone (rsLoRA, as PEFT's
``inject_adapter_in_model`` names them under ``backbone.``, with or without the causal LM's
``model.`` level) and ``value_head.weight`` (no bias). Its prediction is the one this critic makes:
``value_head(normalize(h_last, mse_scale))`` after the last kept block, final norm removed.

``import_reference_ar`` maps every tensor onto the critic built from the meta (on the meta device:
no base weights are read), checks names and shapes strictly, and writes a checkpoint directory that
``critic.checkpoint`` accepts. The backbone's quantisation (``quant: 4bit`` = NF4: the LoRA compensates
its rounding) and a kept final norm (``final_norm_stripped`` false or absent, as the reference trainer
reads it) are recorded in the meta; a run whose ``model.quantization`` differs is refused.
"""
from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

import torch

from nla_grpo.critic.checkpoint import META_NAME, WEIGHTS_NAME, CriticMeta
from nla_grpo.critic.model import base_config
from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.fileio import atomic_directory, load_tensors, read_json_object, save_tensors, write_json

REFERENCE_META = "ar_meta.json"
REFERENCE_WEIGHTS = "ar_lora_value_head.safetensors"


def _read_reference_meta(path: Path) -> dict:
    raw = read_json_object(path, "file not found (expected the reference trainer's AR-LoRA directory)")
    for key in ("ar_num_layers", "lora_r", "lora_alpha"):
        if not isinstance(raw.get(key), int) or isinstance(raw.get(key), bool) or raw[key] < 1:
            raise NlaInputError(path, f"{key}: expected a positive integer, found {raw.get(key)!r}")
    targets = raw.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise NlaInputError(path, f"target_modules: expected a list of module names, found {raw.get('target_modules')!r}")
    quant = raw.get("quant", "none")
    if quant not in (None, "none", "bf16", "4bit"):
        raise NlaInputError(path, f"quant: expected 4bit or none, found {quant!r}")
    stripped = raw.get("final_norm_stripped", False)  # the reference trainer's default when absent: kept
    if not isinstance(stripped, bool):
        raise NlaInputError(path, f"final_norm_stripped: expected true or false, found {stripped!r}")
    return {**raw, "target_modules": targets, "quantization": "nf4" if quant == "4bit" else "none", "final_norm": not stripped}


def _our_name(key: str) -> str | None:
    """The critic's parameter name for a reference tensor name; None when it has no counterpart."""
    if key in ("value_head.weight", "value_head.bias"):
        return key
    m = re.fullmatch(r"backbone\.(?:model\.)?(layers\..+\.lora_[AB])(?:\.default)?\.weight", key)
    return f"backbone.{m.group(1)}.default.weight" if m else None


def _critic_shapes(model_dir: Path, meta: dict) -> dict[str, torch.Size]:
    """Names and shapes of the trainable tensors of the critic the meta describes: ``CriticModel``
    itself, built on the meta device, so the names are the ones ``critic.checkpoint`` loads."""
    from transformers import AutoModel

    from nla_grpo.critic.model import CriticModel, _truncated_config

    config = base_config(model_dir)
    total = int(config.num_hidden_layers)
    if meta["ar_num_layers"] > total:
        raise NlaInputError(model_dir, f"ar_num_layers {meta['ar_num_layers']}: the base model has only {total} blocks")
    config = _truncated_config(config, meta["ar_num_layers"])
    with torch.device("meta"):
        critic = CriticModel(AutoModel.from_config(config), int(config.hidden_size), None)
        critic.add_lora(meta["lora_r"], meta["lora_alpha"], meta["target_modules"], use_rslora=True)
    params = dict(critic.named_parameters())
    return {n: params[n].shape for n in critic.trainable_names()}


def import_reference_ar(ar_dir: str | Path, out_dir: str | Path, model_dir: str | Path) -> CriticMeta:
    """Convert; ``out_dir`` appears only when complete. Returns the written meta."""
    ar_dir, out_dir, model_dir = Path(ar_dir), Path(out_dir), Path(model_dir)
    if out_dir.exists():
        raise NlaInputError(out_dir, "already exists (choose a new directory)")
    meta = _read_reference_meta(ar_dir / REFERENCE_META)
    weights_path = ar_dir / REFERENCE_WEIGHTS
    tensors = load_tensors(weights_path)
    shapes = _critic_shapes(model_dir, meta)
    if "value_head.weight" not in tensors:
        raise NlaInputError(weights_path, "value_head.weight: missing (not an AR-LoRA file?)")
    ours: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        name = _our_name(key)
        if name is None or name not in shapes:
            raise NlaInputError(weights_path, f"unexpected tensor {key!r} (no LoRA or value-head parameter of a "
                                              f"{meta['ar_num_layers']}-block critic on {meta['target_modules']})")
        if tuple(value.shape) != tuple(shapes[name]):
            raise NlaInputError(weights_path, f"tensor {key!r}: expected shape {tuple(shapes[name])}, found {tuple(value.shape)}")
        ours[name] = value.float()  # LoRA and head live in fp32 in this critic
    ours.setdefault("value_head.bias", torch.zeros(shapes["value_head.bias"]))  # the reference head has none
    missing = [n for n in shapes if n not in ours]
    if missing:
        raise NlaInputError(weights_path, f"missing tensor for {missing[0]!r} ({len(missing)} of {len(shapes)} missing)")

    result = CriticMeta(num_layers=meta["ar_num_layers"], d_model=shapes["value_head.bias"][0], lora_r=meta["lora_r"],
                        lora_alpha=meta["lora_alpha"], use_rslora=True, target_modules=list(meta["target_modules"]),
                        base_model=str(model_dir), dtype="float32", quantization=meta["quantization"],
                        final_norm=meta["final_norm"])
    with atomic_directory(out_dir) as tmp:
        save_tensors(tmp / WEIGHTS_NAME, ours)
        write_json(tmp / META_NAME, asdict(result))
    return result
