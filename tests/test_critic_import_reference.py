"""Importing the reference trainer's AR-LoRA directory: the imported critic predicts what the
reference-shaped AR predicts, and every setting it cannot reproduce stops with one line."""
import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import run_cli
from nla_grpo.shared.config import build_config
from nla_grpo.shared.schema import normalize_activation
from nla_grpo.shared.spec import load_spec

TARGETS = ["q_proj", "v_proj", "down_proj"]


class ReferenceShapedAR(torch.nn.Module):
    """Built the reference trainer's way: a causal LM cut to K+1 blocks (final norm dropped), LoRA
    injected into it, a bias-free value head on the normalised last-token state."""

    def __init__(self, model_dir, blocks, r, alpha, keep_norm=False):
        super().__init__()
        from peft import LoraConfig, inject_adapter_in_model
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        config.num_hidden_layers = blocks
        self.backbone = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
        if not keep_norm:
            self.backbone.model.norm = torch.nn.Identity()
        d = config.hidden_size
        self.value_head = torch.nn.Linear(d, d, bias=False)
        inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none", use_rslora=True,
                                           target_modules=TARGETS), self.backbone)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in self.named_parameters():
                if "lora_" in n or n.startswith("value_head"):
                    p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "lora_" in n else 0.2))

    def predict(self, ids, mse_scale):
        h = self.backbone.model(input_ids=ids).last_hidden_state[:, -1]
        return self.value_head(normalize_activation(h, mse_scale))


def _model_with_a_final_norm(tiny_dir, tmp_path):
    """The tiny model with a final RMSNorm weight that is not all ones (else the norm only rescales,
    which the critic's normalisation undoes, and kept or stripped would predict alike)."""
    import shutil

    from safetensors.torch import load_file

    out = tmp_path / "model"
    shutil.copytree(tiny_dir / "model", out)
    sd = load_file(str(out / "model.safetensors"))
    sd["model.norm.weight"] = torch.linspace(0.2, 2.0, sd["model.norm.weight"].numel())
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_reference(tmp_path, tiny_dir, meta_overrides=None, extra=None, model_dir=None):
    blocks, r, alpha = 1, 4, 8
    keep_norm = (meta_overrides or {}).get("final_norm_stripped") is False
    ref = ReferenceShapedAR(model_dir or tiny_dir / "model", blocks, r, alpha, keep_norm=keep_norm)
    d = tmp_path / "ar_ref"
    d.mkdir()
    sd = {n: p.detach().contiguous() for n, p in ref.state_dict().items() if "lora_" in n or n.startswith("value_head")}
    save_file({**sd, **(extra or {})}, str(d / "ar_lora_value_head.safetensors"))
    meta = {"ar_num_layers": blocks, "lora_r": r, "lora_alpha": alpha, "target_modules": TARGETS,
            "final_norm_stripped": True, **(meta_overrides or {})}
    (d / "ar_meta.json").write_text(json.dumps(meta))
    return ref, d


@pytest.mark.parametrize("norm", ["stripped", "kept"])
def test_imported_ar_predicts_like_the_reference(tiny_dir, tmp_path, norm):
    """Also an AR saved with the final norm kept, which the reference trainer still loads as such."""
    from nla_grpo.critic.scoring import Critic

    model = _model_with_a_final_norm(tiny_dir, tmp_path)
    ref, ar = _write_reference(tmp_path, tiny_dir, {"final_norm_stripped": norm == "stripped"}, model_dir=model)
    out = tmp_path / "critic"
    res = run_cli("critic", "import-reference", ar, out, "--model", model)
    assert res.returncode == 0, res.stderr
    assert "use it with critic.checkpoint=" in res.stdout and not (tmp_path / "critic.importing").exists()
    spec = load_spec(tiny_dir / "rl.parquet.nla_meta.yaml")
    # critic.lora_r / lora_alpha unset: the checkpoint's
    cfg = build_config({"model": {"path": str(model), "dtype": "float32"}, "critic": {"checkpoint": str(out)}})
    service = Critic(cfg, spec)
    assert (service.meta.lora_r, service.meta.lora_alpha) == (4, 8)
    assert len(service.model.backbone.layers) == 1
    ids = service.encode(["moss and pine trees on a hill"])[0]
    x = torch.tensor([ids])
    with torch.no_grad():
        ours = service.model(x, torch.ones_like(x))
        theirs = ref.predict(x, spec.mse_scale)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    assert json.loads((out / "critic_meta.json").read_text())["final_norm"] is (norm == "kept")
    # the norm matters: the other choice predicts something else
    other = ReferenceShapedAR(model, 1, 4, 8, keep_norm=norm == "stripped")
    other.load_state_dict(ref.state_dict(), strict=False)
    with torch.no_grad():
        assert not torch.allclose(other.predict(x, spec.mse_scale), theirs, atol=1e-3)
    # the LoRA matters: without it the prediction is another one
    with torch.no_grad():
        for n, p in service.model.named_parameters():
            if "lora_B" in n:
                p.zero_()
        assert not torch.allclose(service.model(x, torch.ones_like(x)), theirs, atol=1e-3)


def test_a_4bit_ar_imports_and_loads_only_into_an_nf4_critic(tiny_dir, tmp_path):
    from nla_grpo.critic.import_reference import import_reference_ar
    from nla_grpo.critic.scoring import Critic
    from nla_grpo.shared.errors import NlaInputError

    _, ar = _write_reference(tmp_path, tiny_dir, {"quant": "4bit"})
    assert import_reference_ar(ar, tmp_path / "critic", tiny_dir / "model").quantization == "nf4"
    cfg = build_config({"model": {"path": str(tiny_dir / "model"), "dtype": "float32"},
                        "critic": {"checkpoint": str(tmp_path / "critic"), "lora_r": 4, "lora_alpha": 8}})
    with pytest.raises(NlaInputError, match=r"critic_meta.json: quantization: the checkpoint has 'nf4' but this critic is "
                                            r"configured with 'none' \(set model.quantization to match\)"):
        Critic(cfg, load_spec(tiny_dir / "rl.parquet.nla_meta.yaml"))


@pytest.mark.parametrize("meta,extra,needle", [
    ({"quant": "8bit"}, None, "quant: expected 4bit or none, found '8bit'"),
    ({"final_norm_stripped": "yes"}, None, "final_norm_stripped: expected true or false"),
    ({"lora_r": 8}, None, "expected shape"),
    ({"ar_num_layers": 9}, None, "the base model has only 2 blocks"),
    (None, {"backbone.model.embed_tokens.weight": torch.zeros(3, 3)}, "unexpected tensor 'backbone.model.embed_tokens.weight'"),
])
def test_bad_reference_directories_stop_with_one_line(tiny_dir, tmp_path, meta, extra, needle):
    from nla_grpo.critic.import_reference import import_reference_ar
    from nla_grpo.shared.errors import NlaInputError

    _, ar = _write_reference(tmp_path, tiny_dir, meta, extra)
    out = tmp_path / "critic"
    with pytest.raises(NlaInputError, match=needle):
        import_reference_ar(ar, out, tiny_dir / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ar_ref"]  # nothing written


def test_import_never_overwrites(tiny_dir, tmp_path):
    _, ar = _write_reference(tmp_path, tiny_dir)
    (tmp_path / "critic").mkdir()
    res = run_cli("critic", "import-reference", ar, tmp_path / "critic", "--model", tiny_dir / "model")
    assert res.returncode == 2 and "already exists" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_the_critic_is_checked_against_its_checkpoint_before_any_actor(tiny_dir, tmp_path):
    from nla_grpo.critic.import_reference import import_reference_ar
    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.errors import NlaInputError

    _, ar = _write_reference(tmp_path, tiny_dir)
    import_reference_ar(ar, tmp_path / "critic", tiny_dir / "model")
    base = {"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")}}
    job = prepare_job(build_config({**base, "critic": {"checkpoint": str(tmp_path / "critic")}}), log=lambda m: None)
    assert (job.cfg.critic.lora_r, job.cfg.critic.lora_alpha) == (4, 8)  # the checkpoint's, for every actor
    with pytest.raises(NlaInputError, match=r"critic_meta.json: lora_r: the checkpoint has 4 but this critic is configured "
                                            r"with 8 \(set critic.lora_r to match\)"):
        prepare_job(build_config({**base, "critic": {"checkpoint": str(tmp_path / "critic"), "lora_r": 8}}), log=lambda m: None)
