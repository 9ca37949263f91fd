"""The one run lifecycle (``orchestrator.lifecycle``) and the one checkpoint layout with its resume rules per stage
(``orchestrator.checkpoint``), for ``train``, ``sft av`` and ``sft ar`` alike."""
import json
from pathlib import Path

import pytest

from nla_grpo.orchestrator.checkpoint import RESUME_RULES, STATE_FILE, RunState, config_change
from nla_grpo.orchestrator.lifecycle import open_run
from nla_grpo.orchestrator.run_dir import RunDir
from nla_grpo.shared.config import build_config
from nla_grpo.shared.errors import NlaInputError

ROOT = Path(__file__).resolve().parents[1]


def test_an_sft_state_round_trips_with_its_stage_and_total(tmp_path):
    RunState(5, config={"seed": 1}, data={"rows": 3}, stage="ar", total=9).write(tmp_path)
    raw = json.loads((tmp_path / STATE_FILE).read_text())
    assert raw == {"step": 5, "config": {"seed": 1}, "data": {"rows": 3}, "stage": "ar", "total": 9}
    back = RunState.read(tmp_path)
    assert (back.stage, back.step, back.total, back.order) == ("ar", 5, 9, None)
    RunState(2, {"cursor": 0}, 3).write(tmp_path)  # an RL state: its order and adapter version, stage rl
    assert RunState.read(tmp_path).stage == "rl" and "total" not in json.loads((tmp_path / STATE_FILE).read_text())
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 2, "stage": "dpo"}))
    with pytest.raises(NlaInputError, match=r"state.json: stage: expected one of rl, av, ar, found 'dpo'"):
        RunState.read(tmp_path)


@pytest.mark.parametrize("stage, field, value, fixed", [
    ("rl", "grpo.steps", 9, False),       # RL: only the listed fields may change
    ("rl", "learner.lr", 1e-3, True),
    ("rl", "logging.every", 7, False),
    ("av", "learner.lr", 1e-3, True),     # AV-SFT: what its adapter depends on is kept
    ("av", "critic.lr", 1e-3, False),
    ("av", "sft.av.steps", 50, False),
    ("ar", "critic.lora_r", 4, True),     # AR-SFT: what its critic depends on is kept
    ("ar", "learner.lr", 1e-3, False),
])
def test_each_stage_keeps_what_its_result_depends_on(stage, field, value, fixed):
    then = build_config({}).model_dump(mode="json")
    section, *rest = field.split(".")
    now = build_config({section: _nested(rest, value)}).model_dump(mode="json")
    change = config_change(stage, then, now)
    assert (change is not None) is fixed and (change is None or change[0] == field and change[2] == value)
    assert config_change(stage, then, now, allowed=(field,)) is None  # a change made on purpose (--set on resume)
    assert set(RESUME_RULES) == {"rl", "av", "ar"}


def _nested(keys, value):
    return {keys[0]: value} if len(keys) == 1 else {keys[0]: _nested(keys[1:], value)}


def test_open_run_takes_a_config_or_a_resume_and_never_both(tmp_path):
    with pytest.raises(NlaInputError, match=r"train: expected either CONFIG.yaml or --resume RUN_DIR"):
        open_run("rl", None, None, None)
    with pytest.raises(NlaInputError, match=r"sft av: --resume continues the run in its own directory"):
        open_run("av", None, str(tmp_path / "x"), str(tmp_path))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("")
    with pytest.raises(NlaInputError, match=r"not empty"):
        open_run("ar", ROOT / "deploy/tiny.yaml", str(tmp_path / "busy"), None)


def _run_of(stage, path, with_checkpoint=True):
    run = RunDir.create(path, build_config({}), stage)
    if with_checkpoint:
        tmp = run.checkpoint_tmp(1)
        RunState(1, config={}, data={}, stage=stage, total=3).write(tmp)
        run.commit_checkpoint(tmp, 1, 0)
    return run


@pytest.mark.parametrize("made, resumed_as, says", [
    ("av", "rl", "a run directory of `sft av`, not of `train`"),
    ("rl", "ar", "a run directory of `train`, not of `sft ar`"),
    ("ar", "av", "a run directory of `sft ar`, not of `sft av`"),
])
def test_a_run_of_another_stage_is_named_before_its_checkpoints_are_read(tmp_path, made, resumed_as, says):
    _run_of(made, tmp_path / "run")
    with pytest.raises(NlaInputError, match=says):
        open_run(resumed_as, None, None, str(tmp_path / "run"))


@pytest.mark.parametrize("logged, checkpoint, kept", [
    ([], False, False),                          # nothing done: the same command works again
    ([{"step": 0, "eval/fve": 0.1}], False, False),  # only the step-0 eval
    ([{"step": 1, "loss": 2.0}], False, True),   # a step was logged: what happened stays readable
    ([], True, True),                            # a checkpoint: it can resume
])
def test_a_new_run_that_fails_leaves_a_directory_only_with_something_in_it(tmp_path, logged, checkpoint, kept):
    start = open_run("av", ROOT / "deploy/tiny.yaml", str(tmp_path / "run"), None)
    run = start.commit(start.cfg)
    assert run.path.is_dir() and (run.path / "config.yaml").is_file() and start.new
    with pytest.raises(RuntimeError), start.running():
        for row in logged:
            run.append_metrics(row)
        if checkpoint:
            tmp = run.checkpoint_tmp(1)
            RunState(1, stage="av").write(tmp)
            run.commit_checkpoint(tmp, 1, 0)
        raise RuntimeError("a rank died")
    assert run.path.is_dir() is kept


def test_a_resumed_run_that_fails_is_kept(tmp_path):
    _run_of("ar", tmp_path / "run", with_checkpoint=False)
    start = open_run("ar", None, None, str(tmp_path / "run"))
    assert not start.new and start.resume_from is None
    with pytest.raises(RuntimeError), start.running():
        raise RuntimeError("a rank died")
    assert (tmp_path / "run" / "config.yaml").is_file()


# the run checkpoint's own file names, written out by hand anywhere but its module
LAYOUT_NAMES = ('"state.json"', '"pending_rollout.json"', '"policy" / "policy"')


def test_one_module_knows_the_run_checkpoint_layout():
    found = [f"{path.relative_to(ROOT)}: {name}" for package in ("orchestrator", "sft", "nla_grpo", "evals")
             for path in sorted((ROOT / package).rglob("*.py")) if path.name != "checkpoint.py" or package != "orchestrator"
             for name in LAYOUT_NAMES if name in path.read_text(encoding="utf-8")]
    assert found == []
