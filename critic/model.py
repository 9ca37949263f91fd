"""The critic network: the subject LLM's first decoder blocks plus a linear value head.

``prediction = value_head(normalize(h_last, mse_scale))`` where ``h_last`` is the residual stream
after the last kept block at the last real token (inputs are right-padded). Normalising before the
head bounds its input norm, which keeps a near-identity head stable under Adam in bf16; at the
identity init the prediction is exactly the normalised hidden state.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.schema import normalize_activation


def base_config(model_path: str | Path):
    """The HF config of the base model, or a one-line error naming the directory."""
    p = Path(model_path)
    if not (p / "config.json").is_file():
        raise NlaInputError(p, "no model here (expected config.json and weights)")
    from nla_grpo.shared.model_facts import hf_config

    return hf_config(p)


def _truncated_config(config, num_layers: int):
    config.num_hidden_layers = num_layers
    # a per-layer list must match the new depth or the config refuses to build
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    return config


def load_truncated_backbone(model_path: str | Path, num_layers: int, dtype: torch.dtype, device: str = "cpu",
                            quantization: str = "none", final_norm: bool = False) -> nn.Module:
    """The base model's embeddings and first ``num_layers`` blocks, final norm replaced by identity
    (or kept, ``final_norm``: ARs the reference trainer saved before it stripped the norm), the blocks
    quantised as ``shared.quantization`` says.

    The weights of later blocks and of lm_head are never materialised: the model is built from a
    truncated config and only the keys it declares are read from the checkpoint.
    """
    import transformers
    from transformers import AutoModel

    config = base_config(model_path)
    total = int(config.num_hidden_layers)
    if not 1 <= num_layers <= total:
        raise NlaInputError("critic.num_layers", f"expected 1..{total} (the base model's depth), found {num_layers}")
    config = _truncated_config(config, num_layers)
    kwargs = {"config": config, "dtype": dtype, "output_loading_info": True}
    if torch.device(device).type != "cpu":
        kwargs["device_map"] = {"": device}
    if quantization != "none":
        from nla_grpo.shared.quantization import hf_quantization_kwargs, require_gpu

        require_gpu(quantization, device)
        kwargs.update(hf_quantization_kwargs(quantization, dtype, model_path))
    # the later blocks show up as "unexpected" keys by design; the load report would only be noise
    log = transformers.utils.logging
    verbosity, bar = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()
    log.disable_progress_bar()
    try:
        backbone, info = AutoModel.from_pretrained(str(model_path), **kwargs)
    finally:
        log.set_verbosity(verbosity)
        if bar:
            log.enable_progress_bar()
    missing = [k for k in info.get("missing_keys", []) if final_norm or not k.startswith("norm.")]
    if missing:
        # a missing key would otherwise stay randomly initialised
        raise NlaInputError(model_path, f"base weights lack {sorted(missing)[0]!r} ({len(missing)} missing)")
    if not final_norm:
        backbone.norm = nn.Identity()
    # a quantised model sits where device_map put it (bitsandbytes refuses .to)
    return (backbone if quantization != "none" else backbone.to(device)).eval()


class CriticModel(nn.Module):
    """Truncated backbone + fp32 ``Linear(d, d)`` value head (identity at init)."""

    def __init__(self, backbone: nn.Module, d_model: int, mse_scale: float | None, quantized: bool = False):
        super().__init__()
        self.backbone = backbone
        self.quantized = quantized  # an NF4 backbone is never trained: without LoRA only the head is
        self.d_model = d_model
        self.mse_scale = mse_scale
        device = next(backbone.parameters()).device
        self.value_head = nn.Linear(d_model, d_model, bias=True, device=device, dtype=torch.float32)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.eye(d_model))
            self.value_head.bias.zero_()
        self.lora: dict | None = None
        self.merged = False  # LoRA folded into the base weights: a scorer only (merge_lora)

    @classmethod
    def from_base(cls, model_path: str | Path, num_layers: int, dtype: torch.dtype, mse_scale: float | None,
                  d_model: int | None = None, device: str = "cpu", quantization: str = "none",
                  final_norm: bool = False) -> "CriticModel":
        backbone = load_truncated_backbone(model_path, num_layers, dtype, device, quantization, final_norm)
        hidden = int(backbone.config.hidden_size)
        if d_model is not None and d_model != hidden:
            raise NlaInputError(model_path, f"hidden_size {hidden} does not match the sidecar's d_model {d_model}")
        return cls(backbone, hidden, mse_scale, quantized=quantization != "none")

    @property
    def num_layers(self) -> int:
        return int(self.backbone.config.num_hidden_layers)

    def add_lora(self, r: int, alpha: int, target_modules: list[str], use_rslora: bool = True) -> None:
        """Wrap the backbone's linear modules with a fresh LoRA (B = 0, so predictions are unchanged)."""
        from peft import LoraConfig, inject_adapter_in_model

        cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none", use_rslora=use_rslora,
                         target_modules=list(target_modules))
        inject_adapter_in_model(cfg, self.backbone)
        # adapters train in fp32 even on a bf16 base: lr-sized Adam updates vanish in bf16 rounding
        for name, param in self.backbone.named_parameters():
            if "lora_" in name:
                param.data = param.data.float()
        self.lora = {"r": r, "alpha": alpha, "target_modules": list(target_modules), "use_rslora": use_rslora}

    def merge_lora(self) -> bool:
        """Fold each LoRA delta into its base weight, for a critic that only scores from here on (reading): its
        forward is then the base GEMMs alone, without the adapters' casts to fp32, their two products and the add
        per linear. Not undone. An NF4 base keeps its adapters (folding would requantise the 4-bit weights).
        True when it merged."""
        if self.lora is None or self.quantized or self.merged:
            return False
        from peft.tuners.lora import LoraLayer

        with torch.no_grad():
            for module in self.backbone.modules():
                if isinstance(module, LoraLayer):
                    module.merge()
        self.merged = True
        return True

    def trainable_names(self) -> list[str]:
        """LoRA tensors + value head with LoRA; every backbone tensor + value head without."""
        names = [n for n, _ in self.named_parameters()]
        if self.lora is None:
            return [n for n in names if n.startswith("value_head.")] if self.quantized else names
        return [n for n in names if "lora_" in n or n.startswith("value_head.")]

    def mark_trainable(self) -> list[nn.Parameter]:
        keep = set(self.trainable_names())
        params = []
        for n, p in self.named_parameters():
            p.requires_grad_(n in keep)
            if n in keep:
                params.append(p)
        return params

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Predictions ``[B, d]`` in fp32 for right-padded ``input_ids``."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        last = attention_mask.long().sum(dim=1) - 1
        h = hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
        return self.value_head(normalize_activation(h, self.mse_scale))
