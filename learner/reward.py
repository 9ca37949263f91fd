"""From samples to rewards: which responses count as explanations, and what each one earns."""
from __future__ import annotations

from nla_grpo.shared.schema import EXPLANATION_CLOSE, EXPLANATION_OPEN, extract_explanation, reward_from_mse


def explanation_for(text: str, finish_reason: str, marker_echo: bool, cap_is_failure: bool = True) -> str | None:
    """The explanation a sample offers the critic, or None for a failed rollout.

    Failed: the response re-creates the marker trigram (it would add a second injection site), or
    it hit the token cap while ``cap_is_failure`` is on (otherwise lengths drift upwards), or it
    has no ``<explanation>…</explanation>``. With ``cap_is_failure`` off (the tiny demo's setting),
    an opened tag that was never closed — cut by the cap or ended by EOS — still counts: a tiny
    random model rarely closes tags on its own.
    """
    if marker_echo:
        return None
    if finish_reason == "length" and cap_is_failure:
        return None
    found = extract_explanation(text)
    if found is not None or cap_is_failure:
        return found
    start = text.find(EXPLANATION_OPEN)
    if start < 0:
        return None
    return text[start + len(EXPLANATION_OPEN):].replace(EXPLANATION_CLOSE, "").strip()


def rewards_for(mses: list[float | None], kind: str, failed: float) -> list[float]:
    """One reward per sample: ``failed`` where the critic gave no mse."""
    return [reward_from_mse(m, kind=kind, failed=failed) for m in mses]
