"""What a step logs about its samples, as pure functions: this project's names and, beside them, the
reference trainer's (its dashboards read those), with the same values where they mean the same; and the wandb
tables and chart logged beside them (``eval_table``, ``judged_tables``, ``pareto_chart``)."""
from __future__ import annotations

import json
import math
import time
import unicodedata

import numpy as np


def _stat(values, fn) -> float:
    """``fn`` over the finite values (NaN when there are none)."""
    xs = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    return float(fn(xs)) if xs else float("nan")


def cjk_fraction(text: str | None) -> float:
    """Share of CJK characters in ``text``: the usual symptom of a verbaliser that lost its injection."""
    if not text:
        return 0.0
    return sum("CJK" in unicodedata.name(c, "") for c in text) / len(text)


def sample_metrics(rewards: list[float], mses: list[float | None], advantages, texts: list[str | None],
                   fve_baseline: float, fve_baseline_meannorm: float) -> dict:
    """Reward, MSE, FVE and advantage statistics of one step's samples (a sample without an MSE, whose
    explanation could not be scored, counts in ``reward_mean_all`` and the extraction rate only)."""
    valid = [m for m in mses if m is not None]
    valid_rewards = [r for r, m in zip(rewards, mses) if m is not None]
    mse = _stat(valid, np.mean)  # NaN without a valid sample, and so are the FVEs
    fve, fve_meannorm = 1.0 - mse / fve_baseline, 1.0 - mse / fve_baseline_meannorm
    adv = np.asarray(advantages, dtype=np.float64)
    return {
        "reward_mean": _stat(valid_rewards, np.mean), "reward_mean_all": _stat(rewards, np.mean),
        "reward_std": _stat(valid_rewards, np.std), "reward_min": _stat(valid_rewards, np.min),
        "reward_max": _stat(valid_rewards, np.max),
        "mse_mean": mse, "mse_std": _stat(valid, np.std), "mse_min": _stat(valid, np.min), "mse_max": _stat(valid, np.max),
        "fve": fve, "fve_pct": fve * 100.0, "fve_meannorm": fve_meannorm, "fve_pct_meannorm": fve_meannorm * 100.0,
        "fve_baseline": fve_baseline, "fve_baseline_meannorm": fve_baseline_meannorm,
        "extraction_rate": len(valid) / len(mses) if mses else float("nan"),
        # torch's std (unbiased), as the advantages' own .std() gives
        "advantage_mean": _stat(adv, np.mean), "advantage_std": float(adv.std(ddof=1)) if adv.size > 1 else float("nan"),
        "mean_cjk": float(np.mean([cjk_fraction(t) for t in texts])) if texts else 0.0,
    }


def eval_metrics(rewards: list[float], mses: list[float | None], fve_baseline: float,
                 explanations: list[str | None] | None = None) -> dict:
    """The held-out eval's summary under this project's names and the reference trainer's; with the samples'
    ``explanations`` also the share that are non-empty and their mean length in characters (of the non-empty)."""
    valid = [m for m in mses if m is not None]
    said = [e.strip() for e in explanations or [] if e and e.strip()]
    shape = {} if explanations is None else {
        "eval/nonempty_rate": len(said) / len(explanations) if explanations else float("nan"),
        "eval/explanation_chars": _stat([len(e) for e in said], np.mean)}
    mse = _stat(valid, np.mean)
    fve = 1.0 - mse / fve_baseline
    return {
        "eval/reward_mean": _stat(rewards, np.mean),
        "eval/reward_mean_valid": _stat([r for r, m in zip(rewards, mses) if m is not None], np.mean),
        "eval/mse_mean": mse, "eval/mse_mean_valid": mse,
        "eval/fve": fve, "eval/fve_pct": fve * 100.0,
        "eval/extraction_rate": len(valid) / len(mses) if mses else float("nan"),
        **shape,
    }


# ---- wandb: the tables and the chart a step logs beside its metrics (wandb is imported only here) ----
def judged_tables(records: list[dict]) -> dict:
    """Each judged eval's records as a wandb Table (``eval/<id>/records``)."""
    import wandb

    out = {}
    for name in dict.fromkeys(r["eval"] for r in records):
        rows = [r for r in records if r["eval"] == name]
        columns = list(dict.fromkeys(k for r in rows for k in r))
        out[f"eval/{name}/records"] = wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in rows])
    return out


def pareto_chart(rows: list[dict]) -> dict:
    """plots/pareto.png as a wandb line series (``pareto/capability_vs_faithfulness``)."""
    import wandb

    from nla_grpo.orchestrator.plot import pareto_series

    series = pareto_series(rows)
    if not series:
        return {}
    return {"pareto/capability_vs_faithfulness": wandb.plot.line_series(
        xs=[xs for xs, _ in series.values()], ys=[ys for _, ys in series.values()], keys=list(series),
        title="capability vs faithfulness", xname="step")}


def _cell(value):
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def eval_table(records: list[dict]):
    """The eval's explanations as a wandb Table (the reference trainer's dashboards show one)."""
    import wandb

    columns = ["step", "row_id", "doc_id", "reward", "mse", "explanation", "text"]
    return wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in records])


class StepTimeline:
    """When each phase of a step began (unix time), for ``timeline.jsonl``: set a step's phase times beside
    what was polled from outside the job (device memory, clocks). ``mark`` returns the phase's name."""

    def __init__(self, clock=None):
        self.clock = clock or time.time
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> str:
        self.marks.append((name, self.clock()))
        return name

    def row(self, step: int) -> dict:
        """``{"step", "phases": [[name, start, end], ...]}``, each phase ending where the next began and the
        last one now; the marks are then cleared for the next step."""
        end = self.clock()
        bounds = [t for _, t in self.marks[1:]] + [end]
        out = {"step": step, "phases": [[name, start, stop] for (name, start), stop in zip(self.marks, bounds)]}
        self.marks = []
        return out
