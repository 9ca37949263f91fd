"""``nla-grpo export NLA OUT``: a trained NLA in the layouts other tools load.

    OUT/verbalizer/     the verbaliser merged into the subject model: a Hugging Face checkpoint (safetensors,
                        config, generation config, tokenizer) that transformers and vLLM load as it is, with
                        ``nla_meta.yaml``, the official release's sidecar (extraction, marker tokens, prompt
                        templates, the injection scale in force) with two sections of its own, which the
                        official reader drops: ``injection`` (mode, scale) and ``generation`` (the prefill,
                        stops, token cap and chat-template switch the verbaliser was trained to answer under)
    OUT/critic/         the reconstructor as this project's critic checkpoint (``critic.checkpoint``)
    OUT/ar/             the reconstructor in the reference trainer's and official release's AR-LoRA layout
                        (``ar_meta.json`` + ``ar_lora_value_head.safetensors``), for a LoRA critic; a critic
                        trained in full has no such form, and the record says so
    OUT/config.yaml     the run config the NLA was trained with (prompts, sampling, stops, injection)
    OUT/nla_export.json what was exported from where, the subject model the activations come from, the FVE baseline

``nla-grpo read OUT`` reads with the export as with the run it came from. OUT appears only when complete.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from nla_grpo.parts import EXPORT_RECORD, locate
from nla_grpo.shared.errors import NlaInputError

EXPORT_FORMAT = "nla-grpo-export"


def _sidecar_with_injection(parts) -> dict:
    import yaml

    meta = yaml.safe_load(Path(parts.spec.path).read_text(encoding="utf-8")) or {}
    cfg = parts.cfg
    scale = cfg.injection.scale if cfg.injection.scale is not None else meta.get("injection_scale")
    meta["injection_scale"] = scale
    meta["injection"] = {"mode": cfg.injection.mode, "scale": scale,
                         **({"karvonen_layer": cfg.injection.karvonen_layer} if cfg.injection.mode == "karvonen" else {})}
    meta["generation"] = {"prefill": cfg.rollout.prefill, "extra_stop_tokens": list(cfg.rollout.extra_stop_tokens),
                          "max_new_tokens": cfg.rollout.max_new_tokens, "cap_is_failure": cfg.rollout.cap_is_failure,
                          "enable_thinking": cfg.prompts.enable_thinking}
    meta.setdefault("extraction", {})["base_model"] = str(parts.subject)
    return meta


def _merge_verbalizer(parts, out: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from nla_grpo.shared.torch_utils import resolve_dtype

    dtype = resolve_dtype(parts.cfg.model.dtype, "cpu")  # merged on the CPU: auto is float32 there
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(parts.subject, dtype=dtype)
        if parts.adapter is not None:
            model = PeftModel.from_pretrained(model, str(parts.adapter)).merge_and_unload()
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(parts.subject).save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    gen = parts.subject / "generation_config.json"
    if gen.is_file() and not (out / "generation_config.json").is_file():
        shutil.copy2(gen, out / "generation_config.json")


def _official_ar(critic: Path, out: Path) -> str | None:
    """The AR-LoRA layout of a LoRA critic; None (and why) for one trained in full."""
    from nla_grpo.critic.checkpoint import WEIGHTS_NAME, read_meta
    from nla_grpo.shared.fileio import load_tensors, save_tensors, write_json

    meta = read_meta(critic)
    if meta.lora_r == 0:
        return (f"the critic was trained in full ({meta.num_layers} block(s), no LoRA): the AR-LoRA layout holds only "
                "LoRA tensors and a value head")
    tensors = load_tensors(critic / WEIGHTS_NAME)
    ours = {}
    for name, value in tensors.items():
        if name.startswith("value_head."):
            if name == "value_head.bias" and not bool((value != 0).any()):
                continue  # the reference head has no bias; a zero one is the same head
            ours[name] = value
        elif ".lora_" in name:
            ours[name.replace(".default.weight", ".weight")] = value
    if "value_head.bias" in ours:
        return "the critic's value head has a bias, which the AR-LoRA layout has no place for"
    out.mkdir(parents=True)
    save_tensors(out / "ar_lora_value_head.safetensors", ours)
    write_json(out / "ar_meta.json", {"ar_num_layers": meta.num_layers, "lora_r": meta.lora_r, "lora_alpha": meta.lora_alpha,
                                      "target_modules": list(meta.target_modules), "final_norm_stripped": not meta.final_norm,
                                      **({"quant": "4bit"} if meta.quantization == "nf4" else {})})
    return None


def export(nla_path, out, log=print) -> Path:
    import yaml

    from nla_grpo.shared.fileio import atomic_directory, write_json

    out = Path(out)
    if out.exists():
        raise NlaInputError(out, "already exists (choose a new directory)")
    parts = locate(nla_path)
    if parts.adapter is None:
        raise NlaInputError(nla_path, "already an export (its verbalizer/ is merged): copy the directory instead")
    log(f"[export] {parts.source} -> {out}")
    with atomic_directory(out) as tmp:
        _merge_verbalizer(parts, tmp / "verbalizer")
        sidecar = _sidecar_with_injection(parts)
        (tmp / "verbalizer" / "nla_meta.yaml").write_text(yaml.safe_dump(sidecar, sort_keys=False, allow_unicode=True), encoding="utf-8")
        shutil.copytree(parts.critic, tmp / "critic", ignore=shutil.ignore_patterns("critic_optimizer*"))
        no_ar = _official_ar(parts.critic, tmp / "ar")
        cfg = parts.cfg.model_copy(update={
            "model": parts.cfg.model.model_copy(update={"path": "verbalizer"}),
            "data": parts.cfg.data.model_copy(update={"sidecar": "verbalizer/nla_meta.yaml"}),
            "learner": parts.cfg.learner.model_copy(update={"adapter_init": None, "reference_adapter": None}),
            "critic": parts.cfg.critic.model_copy(update={"checkpoint": "critic"})})
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True),
                                         encoding="utf-8")
        write_json(tmp / EXPORT_RECORD, {"format": EXPORT_FORMAT, "version": 1, "source": parts.source,
                                         "subject_model": str(parts.subject.resolve()), "layer": parts.spec.layer_index,
                                         "d_model": parts.spec.d_model, "fve_baseline": parts.fve_baseline,
                                         "ar_layout": None if no_ar else "ar/", **({"ar_layout_missing": no_ar} if no_ar else {})})
    log("[export] verbalizer/ (merged, with nla_meta.yaml), critic/" + (", ar/ (AR-LoRA layout)" if not no_ar else
                                                                        f"; no ar/: {no_ar}"))
    return out
