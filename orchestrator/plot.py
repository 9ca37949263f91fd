"""``nla-grpo plot RUN_DIR``: PNG curves of a run's metrics.jsonl (also written at the end of each run)."""
from __future__ import annotations

import math
from pathlib import Path

from nla_grpo.orchestrator.run_dir import RunDir
from nla_grpo.shared.errors import NlaInputError

PANELS = [
    ("reward", ["reward_mean", "reward_mean_all", "eval/reward_mean"]),
    ("FVE", ["fve", "eval/fve"]),
    ("extraction rate", ["extraction_rate", "eval/extraction_rate"]),
    ("KL to reference (k3)", ["kl_mean"]),
    ("clip fraction", ["clip_frac"]),
    ("rollout/learner mismatch", ["logprob_mismatch_k3", "logprob_mismatch_mean_abs"]),
    ("critic loss", ["critic_loss"]),
    ("phase time (s)", ["time/rollout", "time/score", "time/update", "time/critic", "time/push", "time/sleep"]),
]

# an SFT stage's run directory (``nla-grpo sft av|ar``): no rewards, a loss and a held-out eval
SFT_PANELS = [
    ("loss", ["loss"]),
    ("held-out NLL (AV)", ["eval/nll"]),
    ("held-out FVE (AR)", ["eval/fve"]),
    ("learning rate", ["lr"]),
    ("gradient norm", ["grad_norm"]),
    ("tokens/s", ["sft/tokens_per_s"]),
    ("executed TFLOP/s", ["sft/tflops_executed"]),
    ("step time (s)", ["time/step"]),
]


def panels_for(rows: list[dict]) -> list:
    """An SFT stage's panels for its metrics (a loss and a rate, no reward), the RL run's otherwise."""
    sft = not any("reward_mean" in r for r in rows) and any("lr" in r for r in rows)
    return SFT_PANELS if sft else PANELS


def _smooth(ys, k):
    out, acc = [], []
    for y in ys:
        acc.append(y)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def write_plots(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = RunDir.open(run_dir)
    rows = run.read_metrics()
    if not rows:
        raise NlaInputError(run.metrics, "no metrics to plot")
    try:
        run.plots.mkdir(exist_ok=True)
        probe = run.plots / ".write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise NlaInputError(run.plots, f"cannot write plots here: {exc.strerror or exc}") from None
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    k = max(1, len(rows) // 25)
    for ax, (title, keys) in zip(axes.flat, panels_for(rows)):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if key.startswith("eval/") or len(pts) < 3 * k:
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, ms=3, label=key)
            else:
                ax.plot(xs, ys, alpha=0.25, lw=0.8)
                ax.plot(xs, _smooth(list(ys), k), label=f"{key} (mean of {k})")
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(str(run.path))
    fig.tight_layout()
    out = run.plots / "curves.png"
    tmp = run.plots / ".curves.tmp.png"
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(out)
    _pareto(plt, run, rows)
    return out


# capability against faithfulness on one axis: what RL buys and at what cost, step by step
PARETO = [("FVE %", "eval/fve", 100.0), ("hallucinations × 10", "eval/hallucination/hallucinations_mean", 10.0),
          ("captures quirk %", "eval/karvonen_confusion/captures_quirk_rate", 100.0),
          ("clean rate %", "eval/hallucination/clean_rate", 100.0)]


def pareto_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """``{label: (steps, values)}`` of the Pareto chart, from the eval steps' metrics."""
    out = {}
    for label, key, factor in PARETO:
        pts = [(r["step"], r[key] * factor) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if pts:
            out[label] = tuple(map(list, zip(*pts)))
    return out


def _pareto(plt, run: RunDir, rows: list[dict]) -> Path | None:
    """``plots/pareto.png`` when the run has judged evals."""
    series = pareto_series(rows)
    if not any(label != "FVE %" for label in series):
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_title("capability vs faithfulness")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out, tmp = run.plots / "pareto.png", run.plots / ".pareto.tmp.png"
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(out)
    return out
