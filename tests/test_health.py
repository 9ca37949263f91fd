"""Run health (``orchestrator.health``): each sign holds exactly past its threshold, a sign's line is printed
when it starts to hold and again only after it cleared, a healthy run prints nothing, and the eval sign
needs a step-0 eval to compare with."""
import math

from nla_grpo.orchestrator.health import HealthWatch, empty_share, health_signs


def test_empty_share_counts_missing_and_blank_explanations():
    assert empty_share(["salt", None, "", "  ", "tide"]) == 3 / 5
    assert empty_share(["a", "b"]) == 0.0
    assert math.isnan(empty_share([]))


def test_each_sign_holds_only_past_its_threshold():
    at = dict(kl_max=0.5, empty_max=0.5, fve_drop=0.1)
    calm = health_signs({"kl_mean": 0.5, "empty_rate": 0.5, "eval/fve": 0.40}, 0.5, **at)
    assert {k: v[0] for k, v in calm.items()} == {"kl": False, "empty": False, "eval_fve": False}
    bad = health_signs({"kl_mean": 0.51, "empty_rate": 0.51, "eval/fve": 0.39}, 0.5, **at)
    assert {k: v[0] for k, v in bad.items()} == {"kl": True, "empty": True, "eval_fve": True}
    assert "0.51" in bad["kl"][1] and "logging.health_kl" in bad["kl"][1]
    assert "51%" in bad["empty"][1] and "+0.390" in bad["eval_fve"][1] and "+0.500" in bad["eval_fve"][1]


def test_signs_the_row_cannot_tell_are_not_judged():
    # no KL (kl_beta 0), no eval on this step, no step-0 eval to compare with
    assert health_signs({"empty_rate": 0.0}, None, 0.5, 0.5, 0.1).keys() == {"empty"}
    assert health_signs({"empty_rate": 0.0, "eval/fve": -3.0}, None, 0.5, 0.5, 0.1).keys() == {"empty"}
    assert health_signs({"kl_mean": float("nan")}, 0.3, 0.5, 0.5, 0.1) == {}
    assert health_signs({"kl_mean": 3.0}, None, None, 0.5, 0.1) == {}  # a fresh adapter's run: its KL is not judged


def test_the_kl_sign_watches_runs_from_an_adapter_only():
    from nla_grpo.shared.config import build_config

    def watch(adapter):
        raw = {"learner": {"adapter_init": adapter}} if adapter else {}
        return HealthWatch.from_config(build_config(raw, "test"))

    assert watch("/some/adapter").kl_max == 0.5 and watch(None).kl_max is None


def test_a_line_when_a_sign_starts_to_hold_and_again_only_after_it_cleared():
    watch = HealthWatch(kl_max=0.5, empty_max=0.5, fve_drop=0.1, step0_fve=0.6)
    rows = [{"step": 1, "kl_mean": 0.0, "empty_rate": 0.0},
            {"step": 2, "kl_mean": 1.05, "empty_rate": 0.0},
            {"step": 3, "kl_mean": 2.0, "empty_rate": 0.9, "eval/fve": 0.3},
            {"step": 4, "kl_mean": 0.1, "empty_rate": 0.9},
            {"step": 5, "kl_mean": 0.9, "empty_rate": 0.2, "eval/fve": 0.55}]
    lines = [watch.check(r) for r in rows]
    assert lines[0] == [] and lines[3] == []
    assert len(lines[1]) == 1 and lines[1][0].startswith("[health] step 2: KL to the reference 1.05")
    assert [line.split(": ")[1].split()[0] for line in lines[2]] == ["90%", "held-out"]  # the KL line is not repeated
    assert len(lines[4]) == 1 and lines[4][0].startswith("[health] step 5: KL")  # cleared at step 4, back at 5
    assert [r["health/kl"] for r in rows] == [0, 1, 1, 0, 1]
    assert [r["health/empty"] for r in rows] == [0, 0, 1, 1, 0]
    assert [r.get("health/eval_fve") for r in rows] == [None, None, 1, None, 0]


def test_a_healthy_run_prints_nothing():
    watch = HealthWatch(0.5, 0.5, 0.1, step0_fve=0.5)
    rows = [{"step": s, "kl_mean": 0.01 * s, "empty_rate": 0.02, **({"eval/fve": 0.5 + 0.01 * s} if s % 5 == 0 else {})}
            for s in range(1, 30)]
    assert sum((watch.check(r) for r in rows), []) == []
