"""A critic with a trained-looking LoRA, and how far its folded scores lie from fp32 (the CPU and GPU tests')."""
import numpy as np
import torch

from nla_grpo.shared.config import build_config
from nla_grpo.shared.data import read_rows
from nla_grpo.shared.spec import load_spec


def train_lora_b(critic, seed: int = 0, scale: float = 0.05) -> None:
    """Draw the critic's LoRA B away from its zero init, as training would leave it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in critic.model.backbone.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * scale).to(p.device))


def fold_offsets(tiny_dir, device: str) -> tuple[float, float]:
    """Largest |score - fp32 score| over 64 texts of a bf16 LoRA r=16 critic on ``device``: adapters beside the base,
    then folded into it (``merge_lora``); the fp32 critic (the same A and B) scores on the CPU."""
    from nla_grpo.critic.scoring import Critic

    spec = load_spec(tiny_dir / "rl.parquet.nla_meta.yaml")
    golds = torch.from_numpy(read_rows(tiny_dir / "rl.parquet", spec.d_model, max_rows=64).activations)
    texts = ["sea tree leaf " * (1 + i % 5) for i in range(64)]

    def critic(dtype, on):
        torch.manual_seed(1)  # the same LoRA A on both
        c = Critic(build_config({"model": {"path": str(tiny_dir / "model"), "dtype": dtype},
                                 "critic": {"lora_r": 16, "lora_alpha": 16, "micro_batch": 64}}), spec, device=on)
        train_lora_b(c)
        return c

    fp32 = np.array(critic("float32", "cpu").score(texts, golds))
    bf16 = critic("bfloat16", device)
    adapters = np.array(bf16.score(texts, golds))
    assert bf16.model.merge_lora()
    merged = np.array(bf16.score(texts, golds))
    return float(np.abs(adapters - fp32).max()), float(np.abs(merged - fp32).max())
