"""`nla-grpo config check`: a config validated as training would, before any actor or GPU."""
import yaml

from conftest import ROOT, run_cli


def _paths(tiny_dir):
    return ["--set", f"model.path={tiny_dir / 'model'}", "--set", f"data.parquet={tiny_dir / 'rl.parquet'}"]


def test_a_good_config_prints_itself_resolved(tiny_dir):
    from shared.config import build_config, load_config

    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *_paths(tiny_dir), "--set", "grpo.steps=7")
    assert res.returncode == 0, res.stderr
    resolved = build_config(yaml.safe_load(res.stdout), "stdout")
    assert resolved.grpo.steps == 7 and resolved.model.path == str(tiny_dir / "model")
    want = load_config(ROOT / "deploy/tiny.yaml", ["grpo.steps=7"])
    assert resolved.learner == want.learner and resolved.rollout == want.rollout
    assert "Traceback" not in res.stderr


def _refused(res, needle):
    lines = [l for l in res.stderr.splitlines() if l.strip() and not l.startswith("[data]")]
    return res.returncode == 2 and res.stdout == "" and len(lines) == 1 and needle in lines[0]


def test_a_rule_across_fields_is_one_line_before_any_file_is_read(tiny_dir):
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", "--set", "placement.mode=split",
                  "--set", "placement.learner_gpus=0", "--set", "model.dtype=bfloat16", "--set", "critic.lora_r=8")
    assert _refused(res, "deploy/tiny.yaml: placement.learner_gpus: expected 1"), res.stderr


def test_what_training_checks_in_the_files_is_checked_too(tiny_dir, tmp_path):
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", "--set", f"model.path={tmp_path / 'nope'}",
                  "--set", f"data.parquet={tiny_dir / 'rl.parquet'}")
    assert _refused(res, "model directory not found"), res.stderr
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *_paths(tiny_dir), "--set", "injection.mode=karvonen",
                  "--set", "injection.karvonen_layer=5")
    assert _refused(res, "injection.karvonen_layer: expected 0..1"), res.stderr
    res = run_cli("config", "check", tmp_path / "missing.yaml")
    assert _refused(res, "config file not found"), res.stderr
