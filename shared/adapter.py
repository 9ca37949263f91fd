"""A PEFT adapter directory, the one contract every service reads it by (``learner.adapter_init``,
``learner.reference_adapter``, the AV-SFT product, the learner's checkpoints, the engines' file route):

    adapter_config.json         PEFT's LoraConfig: r, lora_alpha, use_rslora, target_modules, rank_pattern, ...
    adapter_model.safetensors   the LoRA tensors (a pickled adapter_model.bin is refused: it would need unpickling)
    nla_injection.json          what the adapter reads (``shared.injection``); nla_sft.json: what AV-SFT trained it on

Its LoRA may sit on linear modules only: vLLM crashes on an embedding or head LoRA under prompt
embeddings (``linear_only_problem``, the rule the config, the checks and the policy apply alike).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nla_grpo.shared.errors import NlaInputError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def targets_list(targets) -> list[str]:
    """PEFT's ``target_modules`` (a list, a set, a single name or None) as a list."""
    return [targets] if isinstance(targets, str) else list(targets or [])


def linear_only_problem(targets, modules_to_save=None) -> str | None:
    """Why a LoRA on ``targets`` (plus ``modules_to_save``) is not on linear modules only, or None."""
    targets = targets_list(targets)
    if any("embed" in t or "lm_head" in t for t in targets) or modules_to_save:
        return (f"expected LoRA on linear modules only (an embedding or head LoRA crashes vLLM under prompt embeddings), "
                f"found target_modules={targets}" + (f", modules_to_save={modules_to_save}" if modules_to_save else ""))
    return None


@dataclass(frozen=True)
class AdapterDir:
    """An adapter directory's config, read once (the tensors are read where they are loaded)."""

    path: Path
    config: dict

    @classmethod
    def read(cls, path, field: str) -> "AdapterDir":
        """The directory at ``path`` (named ``field`` in the config); one line when it is not an adapter."""
        d = Path(path)
        cfg_path = d / ADAPTER_CONFIG
        if not cfg_path.is_file():
            raise NlaInputError(d, f"{field}: expected a PEFT adapter directory (no {ADAPTER_CONFIG})")
        try:
            raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise NlaInputError(cfg_path, "not valid JSON") from None
        if not isinstance(raw, dict):
            raise NlaInputError(cfg_path, f"expected a JSON object, found {type(raw).__name__}")
        return cls(d, raw)

    @property
    def weights(self) -> Path:
        return self.path / ADAPTER_WEIGHTS

    @property
    def targets(self) -> list[str]:
        return targets_list(self.config.get("target_modules"))

    @property
    def max_rank(self) -> int:
        """The largest LoRA rank in it: ``r`` or any ``rank_pattern`` entry."""
        return max([int(self.config.get("r", 8)), *map(int, (self.config.get("rank_pattern") or {}).values())])

    def check_files(self, field: str) -> None:
        """Its tensors are a safetensors file and its LoRA is on linear modules only; one line otherwise."""
        if not self.weights.is_file():
            found = "adapter_model.bin, which would need unpickling" if (self.path / "adapter_model.bin").is_file() else "none"
            raise NlaInputError(self.path, f"{field}: expected {ADAPTER_WEIGHTS}, found {found}")
        problem = linear_only_problem(self.targets, self.config.get("modules_to_save"))
        if problem:
            raise NlaInputError(self.path / ADAPTER_CONFIG, f"target_modules: {problem}")
