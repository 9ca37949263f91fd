"""What a newcomer meets at the command line: every option described with its default, a typo answered
with the key it was meant to be, a bad --set blamed on --set, a missing parquet or a damaged run directory
named in one line."""
import argparse

import pytest

from conftest import ROOT, run_cli, tiny_data


def _parsers(parser, name="nla-grpo"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def test_every_option_says_what_it_does_and_its_default():
    from nla_grpo.orchestrator.cli import _parser

    for name, parser in _parsers(_parser()):
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no description"
            # by identity: a default of 0 is one to show (0 == False)
            if not (action.default is None or action.default is False or action.default == []) and action.option_strings:
                shown = parser._get_formatter()._get_help_string(action) % {"default": action.default}
                assert "default" in shown and str(action.default) in shown, (name, action.dest, shown)
        assert "(default: None)" not in text and "(default: False)" not in text, name
    tiny = dict(_parsers(_parser()))["nla-grpo data tiny"].format_help()
    assert "(default: 0)" in " ".join(tiny.split()), tiny  # --seed


@pytest.mark.parametrize("raw, overrides, line", [
    ({"learner": {"lrr": 1e-4}}, [], "c.yaml: learner.lrr: unknown key (did you mean learner.lr?)"),
    ({"learnr": {}}, [], "c.yaml: learnr: unknown key (did you mean learner?)"),
    ({"rollout": {"group_sise": 4}}, [], "c.yaml: rollout.group_sise: unknown key (did you mean rollout.group_size?)"),
    ({"rollout": {"zzz": 4}}, [], "c.yaml: rollout.zzz: unknown key"),
    ({}, ["learner.lrr=1"], "--set: learner.lrr: unknown key (did you mean learner.lr?)"),
    ({}, ["grpo.steps=0"], "--set: grpo.steps: input should be greater than or equal to 1, found int 0"),
    ({}, ["weight_sync.kind=host", "weight_sync.chunk=3"], "--set: weight_sync.chunk: unknown key (weight_sync.kind=host)"),
])
def test_an_unknown_key_gets_a_suggestion_and_an_override_is_named_as_one(raw, overrides, line):
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.errors import NlaInputError

    with pytest.raises(NlaInputError) as exc:
        build_config(raw, "c.yaml", overrides)
    assert str(exc.value) == line


def test_a_bad_set_is_blamed_on_set_at_the_command_line(tiny_dir):
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *tiny_data(tiny_dir), "--set", "learner.lrr=1")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == "nla-grpo: error: --set: learner.lrr: unknown key (did you mean learner.lr?)", res.stderr


def test_a_misspelt_parquet_is_a_missing_parquet(tiny_dir, tmp_path):
    wrong = tmp_path / "rl.parquett"
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", "--set", f"model.path={tiny_dir / 'model'}",
                  "--set", f"data.parquet={wrong}")
    assert res.returncode == 2
    assert res.stderr.strip() == f"nla-grpo: error: {wrong}: parquet not found (config data.parquet)", res.stderr


@pytest.mark.parametrize("damage, problem", [
    ("model: {path: [unclosed\n", "not valid YAML (line 2: expected ',' or ']', but got '<stream end>')"),
    ("!!python/object/apply:os.system ['touch PWNED']\n", "not valid YAML (line 1: could not determine a constructor"),
])
def test_a_damaged_run_directory_config_is_named_and_never_executed(tmp_path, damage, problem):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(damage)
    res = run_cli("train", "--resume", run, cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nla-grpo: error: {run / 'config.yaml'}: {problem}"), lines
    assert not (tmp_path / "PWNED").exists()


def test_the_step_line_tail_reads_elapsed_pace_and_time_left():
    from nla_grpo.orchestrator.driver import clock, progress

    assert clock(0) == "0:00:00" and clock(59.6) == "0:01:00" and clock(3 * 3600 + 62) == "3:01:02"
    assert progress(10.0, 4, 6) == "0:00:10 elapsed, 2.50 s/step, eta 0:00:15"
    assert progress(5.0, 0, 3).endswith("eta 0:00:15")  # no step done yet in this process: never divides by zero


def _as_submitted_job(tmp_path):
    """The environment and working directory ``ray job submit --working-dir`` gives its entrypoint."""
    import json

    copy = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    (copy / "deploy").mkdir(parents=True)
    (copy / "deploy" / "tiny.yaml").write_text((ROOT / "deploy/tiny.yaml").read_text())
    env = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}})}
    return copy, env


def _run_in(cwd, env, *args):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "nla_grpo.orchestrator.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT), **env))


def test_a_submitted_job_keeps_its_runs_out_of_rays_copy(tiny_dir, tmp_path):
    copy, env = _as_submitted_job(tmp_path)
    for extra in ([], ["--run-dir", "runs/mine"], ["--run-dir", copy / "runs" / "abs"]):
        res = _run_in(copy, env, "train", "deploy/tiny.yaml", *extra, *tiny_data(tiny_dir))
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "inside Ray's temporary copy of the working directory" in lines[0], lines
        assert "pass --run-dir" in lines[0]
    res = _run_in(copy, env, "train", "--resume", "runs/old")
    assert res.returncode == 2 and "inside Ray's temporary copy" in res.stderr
    assert not (copy / "runs").exists()
    # on storage outside the copy it goes on (here to the next check: a model that is not there)
    outside = tmp_path / "shared" / "runs" / "a"
    res = _run_in(copy, env, "train", "deploy/tiny.yaml", "--run-dir", outside, "--set", f"model.path={tmp_path / 'nope'}",
                  "--set", f"data.parquet={tiny_dir / 'rl.parquet'}")
    assert res.returncode == 2 and "model directory not found" in res.stderr, res.stderr
    # and outside `ray job submit` the default runs/ is fine
    res = _run_in(copy, {}, "train", "deploy/tiny.yaml", "--set", f"model.path={tmp_path / 'nope'}")
    assert res.returncode == 2 and "model directory not found" in res.stderr, res.stderr


def test_doctor_reports_this_node_and_a_cluster_it_cannot_reach(tmp_path):
    res = _run_in(ROOT, {"RAY_ADDRESS": ""}, "doctor", "--run-dir", tmp_path / "runs")
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines[-1] == "doctor: ok", res.stdout + res.stderr
    for part in ("python ", "torch ", "transformers ", "peft ", "ray ", "vllm ", "bitsandbytes", f"run dir {tmp_path / 'runs'}: "):
        assert any(part in l for l in lines), (part, lines)
    res = _run_in(ROOT, {"RAY_ADDRESS": "127.0.0.1:9"}, "doctor", "--run-dir", tmp_path, "--ray-timeout", "5")
    bad = [l for l in res.stdout.splitlines() if l.startswith("BAD")]
    assert res.returncode == 1 and len(bad) == 1 and "RAY_ADDRESS=127.0.0.1:9" in bad[0], res.stdout
    assert res.stdout.strip().splitlines()[-1] == "doctor: 1 problem(s): see the BAD lines"
