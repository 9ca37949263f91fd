"""A step's sample statistics under this project's names and the reference trainer's."""
import math

import pytest
import torch

from nla_grpo.orchestrator.metrics import cjk_fraction, eval_metrics, sample_metrics


def test_sample_metrics_carry_the_reference_trainers_names_with_the_same_values():
    rewards, mses = [1.0, -2.0, 0.5, -9.0], [0.2, 0.8, 0.4, None]  # the last explanation could not be scored
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    m = sample_metrics(rewards, mses, adv, ["a tree", "树木", None, "x"], fve_baseline=2.0, fve_baseline_meannorm=4.0)
    assert m["reward_mean"] == pytest.approx(-0.5 / 3) and m["reward_mean_all"] == pytest.approx(-9.5 / 4)
    assert (m["reward_min"], m["reward_max"]) == (-2.0, 1.0)
    assert (m["mse_min"], m["mse_max"]) == (0.2, 0.8)
    assert m["mse_mean"] == pytest.approx((0.2 + 0.8 + 0.4) / 3)
    assert m["mse_std"] == pytest.approx(torch.tensor([0.2, 0.8, 0.4]).std(unbiased=False).item())
    assert m["fve"] == pytest.approx(1 - m["mse_mean"] / 2.0) and m["fve_pct"] == pytest.approx(100 * m["fve"])
    assert m["fve_pct_meannorm"] == pytest.approx(100 * (1 - m["mse_mean"] / 4.0)) and m["fve_baseline_meannorm"] == 4.0
    assert m["extraction_rate"] == 0.75
    assert m["advantage_mean"] == pytest.approx(0.0) and m["advantage_std"] == pytest.approx(adv.std().item())
    assert m["mean_cjk"] == pytest.approx((0 + 1 + 0 + 0) / 4)


def test_cjk_fraction_and_empty_batches():
    assert cjk_fraction("ab树") == pytest.approx(1 / 3) and cjk_fraction("") == 0.0 and cjk_fraction(None) == 0.0
    m = sample_metrics([-9.0], [None], torch.tensor([0.0]), ["x"], 2.0, 4.0)
    assert math.isnan(m["reward_mean"]) and math.isnan(m["fve_pct"]) and m["extraction_rate"] == 0.0
    e = eval_metrics([1.0, -9.0], [0.5, None], fve_baseline=2.0)
    assert e["eval/mse_mean_valid"] == e["eval/mse_mean"] == 0.5 and e["eval/fve_pct"] == pytest.approx(75.0)
    assert e["eval/reward_mean"] == pytest.approx(-4.0) and e["eval/reward_mean_valid"] == 1.0
    assert "eval/nonempty_rate" not in e  # without the explanations there is nothing to say of them


def test_the_eval_says_how_many_explanations_are_non_empty_and_how_long():
    e = eval_metrics([1.0, -2.0, 0.5, -2.0], [0.5, None, 0.7, None], 2.0, ["salt", None, " tide ", "  "])
    assert e["eval/nonempty_rate"] == 0.5 and e["eval/explanation_chars"] == 4.0
    e = eval_metrics([-2.0], [None], 2.0, [None])
    assert e["eval/nonempty_rate"] == 0.0 and math.isnan(e["eval/explanation_chars"])


def test_a_step_timeline_closes_each_phase_where_the_next_begins():
    from nla_grpo.orchestrator.metrics import StepTimeline

    ticks = iter([10.0, 12.5, 13.0, 20.0, 21.0, 30.0])
    tl = StepTimeline(clock=lambda: next(ticks))
    assert tl.mark("rollout") == "rollout"
    tl.mark("score")
    tl.mark("update")
    assert tl.row(4) == {"step": 4, "phases": [["rollout", 10.0, 12.5], ["score", 12.5, 13.0], ["update", 13.0, 20.0]]}
    tl.mark("rollout")
    assert tl.row(5) == {"step": 5, "phases": [["rollout", 21.0, 30.0]]}  # the marks start anew each step
