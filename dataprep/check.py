"""``nla-grpo data check``: everything a run needs from a dataset, checked against its sidecar and tokenizer."""
from __future__ import annotations

import sys
from pathlib import Path

from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.model_checks import check_model_against_spec


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
    from nla_grpo.shared.data import open_parquet, read_rows, split_eval
    from nla_grpo.shared.prompts import prompt_table
    from nla_grpo.shared.spec import load_spec, sidecar_path

    open_parquet(parquet)
    spec = load_spec(sidecar or sidecar_path(parquet))
    mdir = resolve_model_dir(spec, model_dir)
    tok = check_model_against_spec(spec, mdir)

    def progress(done, total):
        if total >= 20000:
            print(f"  read {done}/{total} rows", file=out, flush=True)

    rows = read_rows(parquet, spec.d_model, progress=progress)
    table, _ = prompt_table([rows], tok, spec, prefill, parquet, enable_thinking)
    train, ev = split_eval(rows, eval_fraction)
    return report(parquet, spec, mdir, train, ev, len(table), out)


def report(parquet, spec, model_dir, train, ev, prompts: int, out=sys.stdout) -> dict:
    """The summary of a checked dataset, printed after its ``ok:`` line."""
    summary = {
        "rows": len(train) + len(ev), "d_model": spec.d_model, "layer_index": spec.layer_index,
        "documents": len(set(train.doc_ids) | set(ev.doc_ids)), "train_rows": len(train), "eval_rows": len(ev),
        "distinct_prompts": prompts, "marker": spec.marker, "marker_id": spec.marker_id,
        "neighbour_ids": [spec.left_id, spec.right_id], "injection_scale": spec.injection_scale_raw,
        "mse_scale": spec.mse_scale_raw, "model": str(model_dir),
    }
    print(f"ok: {parquet}", file=out)
    for k, v in summary.items():
        print(f"  {k}: {v}", file=out)
    return summary
