import json

import pytest

from nla_grpo.learner.reward import explanation_for, rewards_for
from nla_grpo.orchestrator.run_dir import RunDir
from nla_grpo.shared.config import RunConfig


@pytest.mark.parametrize("text,finish,echo,strict,expected", [
    ("<explanation>sea ship</explanation>", "stop", False, True, "sea ship"),
    ("<explanation>sea ship</explanation>", "length", False, True, None),   # cap hit = failed
    ("<explanation>sea ship</explanation>", "length", False, False, "sea ship"),
    ("<explanation>sea ship", "length", False, True, None),
    ("<explanation>sea ship", "length", False, False, "sea ship"),         # lenient: open tag counts
    ("<explanation>sea ship", "stop", False, False, "sea ship"),
    ("no tag", "stop", False, False, None),
    ("<explanation>sea</explanation>", "stop", True, True, None),          # marker echo = failed
])
def test_explanation_for(text, finish, echo, strict, expected):
    assert explanation_for(text, finish, echo, strict) == expected


def test_rewards_for():
    assert rewards_for([None, 0.5, float("nan")], "neg_log_mse", -2.0)[0] == -2.0
    r = rewards_for([1.0, 0.25], "neg_mse", -3.0)
    assert r == [-1.0, -0.25]


def test_run_dir_logs_and_atomic_checkpoints(tmp_path):
    run = RunDir.create(tmp_path / "run", RunConfig())
    for s in range(1, 6):
        run.append_metrics({"step": s, "x": float(s), "bad": float("nan")})
    with run.metrics.open("a") as f:
        f.write('{"step": 6, "x": ')  # a line cut by a kill
    rows = run.read_metrics()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[0]["bad"] is None
    run.truncate_logs(3)  # resuming from step_000003: steps 1-3 stay, later ones are redone
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]
    # an unfinished checkpoint is invisible; finished ones are kept up to keep_last
    tmp = run.checkpoint_tmp(10)
    (tmp / "state.json").write_text(json.dumps({"step": 10}))
    assert run.latest_checkpoint() is None
    run.commit_checkpoint(tmp, 10, keep_last=2)
    for s in (20, 30):
        t = run.checkpoint_tmp(s)
        (t / "state.json").write_text("{}")
        run.commit_checkpoint(t, s, keep_last=2)
    run.checkpoint_tmp(40)  # killed mid-write
    assert [p.name for p in run.list_checkpoints()] == ["step_000020", "step_000030"]
    assert run.latest_checkpoint().name == "step_000030"
    for s in (50, 60):  # keep_last 0 (the default) keeps every one
        t = run.checkpoint_tmp(s)
        (t / "state.json").write_text("{}")
        run.commit_checkpoint(t, s, keep_last=RunConfig().checkpointing.keep_last)
    assert [p.name for p in run.list_checkpoints()] == ["step_000020", "step_000030", "step_000050", "step_000060"]
    assert RunDir.open(run.path).config() == RunConfig()
