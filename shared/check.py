"""``nla-grpo data check``: validate an RL parquet against its sidecar and the live tokenizer."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from shared.errors import NlaInputError


def load_tokenizer(model_dir: str | Path):
    """AutoTokenizer from a local directory, with a one-line error when it is not one."""
    p = Path(model_dir)
    if not (p / "tokenizer_config.json").is_file() and not (p / "tokenizer.json").is_file():
        raise NlaInputError(p, "no tokenizer here (expected tokenizer.json / tokenizer_config.json)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def model_config_field(model_dir: str | Path, key: str) -> int | None:
    """An integer field of the model's config.json (top level or its text_config); None when absent."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    raw = json.loads(cfg.read_text())
    return raw.get(key) or (raw.get("text_config") or {}).get(key)


def model_hidden_size(model_dir: str | Path) -> int | None:
    return model_config_field(model_dir, "hidden_size")


def resolve_model_dir(spec, model_dir: str | None) -> Path:
    if model_dir:
        p = Path(model_dir)
        if not p.is_dir():
            raise NlaInputError(p, "model directory not found")
        return p
    found = spec.resolve_base_model()
    if found is None:
        raise NlaInputError(spec.path, f"base_model {spec.base_model!r} is not a local directory: pass --model DIR")
    return found


def check_dataset(parquet: str, sidecar: str | None = None, model_dir: str | None = None, eval_fraction: float = 0.1,
                  out=sys.stdout, prefill: str = "", enable_thinking: bool | None = None) -> dict:
    """Validate everything a run needs from the data (prompts rendered with ``prefill``); return and print a summary."""
    from shared.data import open_parquet, read_rows, split_eval
    from shared.prompts import prompt_table
    from shared.spec import load_spec, sidecar_path, validate_against_tokenizer

    open_parquet(parquet)
    spec = load_spec(sidecar or sidecar_path(parquet))
    mdir = resolve_model_dir(spec, model_dir)
    hidden = model_hidden_size(mdir)
    if hidden is not None and hidden != spec.d_model:
        raise NlaInputError(spec.path, f"extraction.d_model: expected {hidden} (hidden_size of {mdir}), found {spec.d_model}")
    tok = load_tokenizer(mdir)
    validate_against_tokenizer(spec, tok)

    def progress(done, total):
        if total >= 20000:
            print(f"  read {done}/{total} rows", file=out, flush=True)

    rows = read_rows(parquet, spec.d_model, progress=progress)
    table, _ = prompt_table([rows], tok, spec, prefill, parquet, enable_thinking)
    train, ev = split_eval(rows, eval_fraction)
    summary = {
        "rows": len(rows), "d_model": spec.d_model, "layer_index": spec.layer_index,
        "documents": len(set(rows.doc_ids)), "train_rows": len(train), "eval_rows": len(ev),
        "distinct_prompts": len(table), "marker": spec.marker, "marker_id": spec.marker_id,
        "neighbour_ids": [spec.left_id, spec.right_id], "injection_scale": spec.injection_scale_raw,
        "mse_scale": spec.mse_scale_raw, "model": str(mdir),
    }
    print(f"ok: {parquet}", file=out)
    for k, v in summary.items():
        print(f"  {k}: {v}", file=out)
    return summary


def check_target_modules(model_dir, target_modules: list[str], field: str = "learner.target_modules") -> None:
    """Every LoRA target names a linear module of the model (checked on the meta device: no weights are
    read), so a typo stops before any actor starts instead of inside one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in target_modules if t not in linear]
    if missing:
        raise NlaInputError("config", f"{field}: {missing} not among the linear modules of {model_dir} "
                                      f"({', '.join(sorted(linear - {'lm_head'}))})")
