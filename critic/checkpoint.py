"""AR checkpoint directories: trainable tensors in safetensors, everything else in JSON.

A directory holds
- ``critic_meta.json``: architecture (kept blocks, LoRA settings, d_model) and provenance;
- ``critic_weights.safetensors``: the trainable tensors only (LoRA + value head, or the whole
  truncated backbone + value head when fully fine-tuned), named as in ``CriticModel``;
- optionally ``critic_optimizer.safetensors`` + ``critic_optimizer.json``: the optimiser's tensors
  and its scalars / param groups, for an exact resume.

Nothing is ever unpickled. Loading is strict: every expected tensor must be present with its shape
and nothing else may be, so a renamed key can never leave a randomly initialised head in place.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nla_grpo.shared import fileio
from nla_grpo.shared.errors import NlaInputError

META_NAME = "critic_meta.json"
WEIGHTS_NAME = "critic_weights.safetensors"
OPTIM_TENSORS_NAME = "critic_optimizer.safetensors"
OPTIM_META_NAME = "critic_optimizer.json"
FORMAT = "nla-grpo-critic"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CriticMeta:
    """What is needed to rebuild the critic's structure before loading its tensors."""

    num_layers: int
    d_model: int
    lora_r: int = 0
    lora_alpha: int = 16
    use_rslora: bool = True
    target_modules: list[str] = field(default_factory=list)
    base_model: str = ""
    dtype: str = "float32"
    quantization: str = "none"  # the backbone's (shared.quantization): a LoRA trained on NF4 compensates its rounding
    final_norm: bool = False  # the base's final RMSNorm kept after the last block (older reference-trainer ARs)
    format: str = FORMAT
    version: int = FORMAT_VERSION


_META_TYPES = {"num_layers": int, "d_model": int, "lora_r": int, "lora_alpha": int, "use_rslora": bool,
               "target_modules": list, "base_model": str, "dtype": str, "quantization": str, "final_norm": bool,
               "format": str, "version": int}


def read_meta(ckpt_dir: str | Path) -> CriticMeta:
    """The checkpoint's meta file, every field type-checked; errors name the file and the key."""
    p = Path(ckpt_dir) / META_NAME
    if not p.is_file():
        raise NlaInputError(p, "critic checkpoint meta not found")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise NlaInputError(p, "not valid JSON") from None
    if not isinstance(raw, dict):
        raise NlaInputError(p, "expected a JSON object")
    for key in raw:
        if key not in _META_TYPES:
            raise NlaInputError(p, f"{key}: unknown key")
    for key in ("num_layers", "d_model"):
        if key not in raw:
            raise NlaInputError(p, f"{key}: missing")
    for key, kind in _META_TYPES.items():
        if key in raw and (not isinstance(raw[key], kind) or (kind is int and isinstance(raw[key], bool))):
            raise NlaInputError(p, f"{key}: expected {kind.__name__}, found {raw[key]!r}")
    meta = CriticMeta(**raw)
    if meta.format != FORMAT or meta.version != FORMAT_VERSION:
        raise NlaInputError(p, f"format: expected {FORMAT} v{FORMAT_VERSION}, found {meta.format} v{meta.version}")
    if meta.num_layers < 1 or meta.d_model < 1 or meta.lora_r < 0:
        raise NlaInputError(p, "num_layers, d_model: expected >= 1; lora_r: expected >= 0")
    if meta.quantization not in ("none", "nf4"):
        raise NlaInputError(p, f"quantization: expected none or nf4, found {meta.quantization!r}")
    if meta.lora_r > 0 and not meta.target_modules:
        raise NlaInputError(p, "target_modules: expected the LoRA's modules when lora_r > 0")
    return meta


def save_weights(ckpt_dir: str | Path, model, meta: CriticMeta) -> None:
    """Trainable tensors then the meta file (written last: its presence marks a complete save)."""
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    fileio.save_tensors(d / WEIGHTS_NAME, {n: params[n] for n in model.trainable_names()})
    fileio.write_json(d / META_NAME, asdict(meta))


def load_weights(ckpt_dir: str | Path, model) -> None:
    """Copy the checkpoint's tensors into ``model``; any missing, extra or misshapen key is an error."""
    path = Path(ckpt_dir) / WEIGHTS_NAME
    tensors = fileio.load_tensors(path)
    expected = model.trainable_names()
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise NlaInputError(path, f"missing tensor {missing[0]!r} ({len(missing)} missing of {len(expected)} expected)")
    known = set(expected)
    extra = [k for k in tensors if k not in known]
    if extra:
        raise NlaInputError(path, f"unexpected tensor {extra[0]!r} ({len(extra)} not in the critic built from the meta)")
    params = dict(model.named_parameters())
    for name in expected:
        if tuple(tensors[name].shape) != tuple(params[name].shape):
            raise NlaInputError(path, f"tensor {name!r}: expected shape {tuple(params[name].shape)}, found {tuple(tensors[name].shape)}")
    with torch.no_grad():
        for name in expected:
            params[name].copy_(tensors[name].to(params[name].dtype))


def has_optimizer_state(ckpt_dir: str | Path) -> bool:
    d = Path(ckpt_dir)
    return (d / OPTIM_META_NAME).is_file() and (d / OPTIM_TENSORS_NAME).is_file()


def save_optimizer(ckpt_dir: str | Path, optimizer, param_names: list[str]) -> None:
    """``optimizer.state_dict()`` split into tensors (safetensors) and the rest (JSON), as the learner's."""
    fileio.save_optimizer(ckpt_dir, optimizer, param_names, OPTIM_TENSORS_NAME, OPTIM_META_NAME)


def load_optimizer(ckpt_dir: str | Path, optimizer, param_names: list[str]) -> None:
    """Restore a state saved by ``save_optimizer``; the optimiser kind and parameter list must match."""
    fileio.load_optimizer(ckpt_dir, optimizer, param_names, OPTIM_TENSORS_NAME, OPTIM_META_NAME, what="critic")


# ---- a frozen critic: checkpoints record what it was built from instead of copying it -----------
FROZEN_RECORD = "critic.json"
FROZEN_FORMAT = "nla-grpo-frozen-critic"


def write_frozen_record(record: str | Path, checkpoint: str | Path | None) -> None:
    """For a critic that never trains: the SHA-256 of the AR checkpoint it was loaded from, or, without
    one, that it is built from the base model as the config says (identity value head, no LoRA update)."""
    files = {}
    if checkpoint is not None:
        files = {n: fileio.sha256_file(Path(checkpoint) / n) for n in (META_NAME, WEIGHTS_NAME)}
    fileio.write_json(record, {"format": FROZEN_FORMAT, "source": "critic.checkpoint" if checkpoint else "model",
                               "sha256": files})


def check_frozen_record(record: str | Path, checkpoint: str | Path | None) -> None:
    """The critic this run builds (from ``checkpoint``, the config's ``critic.checkpoint``) is the one the
    record was written with; a one-line error naming the record otherwise."""
    raw = fileio.read_json_object(record)
    if raw.get("format") != FROZEN_FORMAT or raw.get("source") not in ("critic.checkpoint", "model") \
            or not isinstance(raw.get("sha256"), dict):
        raise NlaInputError(record, f"expected a {FROZEN_FORMAT} record (format, source, sha256)")
    if (raw["source"] == "model") != (checkpoint is None):
        now = f"critic.checkpoint {checkpoint}" if checkpoint else "the base model (no critic.checkpoint)"
        raise NlaInputError(record, f"the frozen critic came from {raw['source']}, this run builds it from {now}")
    if raw["sha256"]:
        fileio.verify_digests(record, checkpoint, raw["sha256"], "critic.checkpoint")
