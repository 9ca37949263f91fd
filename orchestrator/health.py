"""Run health: the signs that an RL run is destroying what it started from, checked on every step's
metrics and reported as they happen.

Three signs, each a pure function of the step's metrics row (and of the step-0 eval, for the last):
- ``kl``: the k3 KL to the frozen reference, measured in the update, above ``logging.health_kl``, in a run
  that starts from an adapter (``learner.adapter_init``: its reference is what SFT learned). A warm start
  at a rate suited to it stays far below it; a rate meant for a fresh adapter moves the policy that far
  within a few updates. A run from a fresh adapter is meant to leave its start: its KL is not judged.
- ``empty``: more than ``logging.health_empty`` of the step's samples give no explanation or an empty one
  (the collapse a reward hacked by saying nothing looks like).
- ``eval_fve``: the held-out FVE more than ``logging.health_fve_drop`` below its step-0 value.

Each is logged every step as ``health/<sign>`` (1 when it holds, 0 when not; the eval sign on eval steps
only) and printed as one ``[health]`` line when it starts to hold, again only after it has cleared. A
healthy run prints nothing.
"""
from __future__ import annotations

import math


def _num(row: dict, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None


def empty_share(explanations: list[str | None]) -> float:
    """Share of samples without an explanation or with an empty one."""
    if not explanations:
        return float("nan")
    return sum(1 for e in explanations if not (e or "").strip()) / len(explanations)


def health_signs(row: dict, step0_fve: float | None, kl_max: float | None, empty_max: float, fve_drop: float) -> dict[str, tuple[bool, str]]:
    """``{sign: (holds, why)}`` for the signs the row can tell (the KL sign only with ``kl_max``, the eval sign
    only on an eval row after a step-0 eval); ``why`` says what was seen against what was expected, on one line."""
    out: dict[str, tuple[bool, str]] = {}
    kl = _num(row, "kl_mean")
    if kl is not None and kl_max is not None:
        out["kl"] = (kl > kl_max, f"KL to the reference {kl:.3g} (k3 mean) after the update, above {kl_max:g} "
                                  "(logging.health_kl): the policy is leaving its start fast; lower learner.lr or raise grpo.kl_beta")
    empty = _num(row, "empty_rate")
    if empty is not None:
        out["empty"] = (empty > empty_max, f"{empty:.0%} of the explanations are missing or empty, above {empty_max:.0%} "
                                           "(logging.health_empty): the policy is learning to say nothing")
    fve = _num(row, "eval/fve")
    if fve is not None and step0_fve is not None:
        out["eval_fve"] = (fve < step0_fve - fve_drop, f"held-out FVE {fve:+.3f}, more than {fve_drop:g} below its step-0 "
                                                       f"{step0_fve:+.3f} (logging.health_fve_drop): RL is undoing what SFT learned")
    return out


class HealthWatch:
    """Adds ``health/<sign>`` to each row and returns the ``[health]`` lines to print: a sign's line when it
    starts to hold (again only after a step where it did not)."""

    def __init__(self, kl_max: float | None, empty_max: float, fve_drop: float, step0_fve: float | None = None):
        self.kl_max, self.empty_max, self.fve_drop = kl_max, empty_max, fve_drop
        self.step0_fve = step0_fve
        self.holding: set[str] = set()

    @classmethod
    def from_config(cls, cfg, step0_fve: float | None = None) -> "HealthWatch":
        lg = cfg.logging
        return cls(lg.health_kl if cfg.learner.adapter_init else None, lg.health_empty, lg.health_fve_drop, step0_fve)

    def check(self, row: dict) -> list[str]:
        lines = []
        for sign, (holds, why) in health_signs(row, self.step0_fve, self.kl_max, self.empty_max, self.fve_drop).items():
            row[f"health/{sign}"] = int(holds)
            if holds and sign not in self.holding:
                lines.append(f"[health] step {row['step']}: {why}")
            (self.holding.add if holds else self.holding.discard)(sign)
        return lines
