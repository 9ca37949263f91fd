"""`nla-grpo config check`: a config validated as training would, before any actor or GPU."""
import yaml

from conftest import ROOT, run_cli


def _paths(tiny_dir):
    return ["--set", f"model.path={tiny_dir / 'model'}", "--set", f"data.parquet={tiny_dir / 'rl.parquet'}"]


def test_a_good_config_is_one_ok_line_and_show_prints_it_resolved(tiny_dir):
    from nla_grpo.shared.config import build_config, load_config

    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *_paths(tiny_dir), "--set", "grpo.steps=7")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.splitlines() == [res.stdout.strip()] and res.stdout.startswith(f"ok: {ROOT / 'deploy/tiny.yaml'}: 7 steps of ")
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *_paths(tiny_dir), "--set", "grpo.steps=7", "--show")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1].startswith("# ok: ")
    resolved = build_config(yaml.safe_load(res.stdout), "stdout")
    assert resolved.grpo.steps == 7 and resolved.model.path == str(tiny_dir / "model")
    want = load_config(ROOT / "deploy/tiny.yaml", ["grpo.steps=7"])
    assert resolved.learner.model_dump() == want.learner.model_dump()
    # the job-time auto values (shared.resolve) come resolved, and nothing else of the section moves
    assert want.rollout.vector_input == "auto" and resolved.rollout.vector_input == "prompt_embeds"  # the CPU engines
    assert want.rollout.max_prompt_tokens is None and 8 < resolved.rollout.max_prompt_tokens < 200  # the longest prompt
    assert want.logging.eval_at_start == "auto" and resolved.logging.eval_at_start is False  # a start from scratch
    changed = {k for k, v in resolved.rollout.model_dump().items() if v != want.rollout.model_dump()[k]}
    assert changed == {"vector_input", "max_prompt_tokens"}
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
    assert _refused(res, "injection.karvonen_layer: expected 0..0"), res.stderr
    res = run_cli("config", "check", tmp_path / "missing.yaml")
    assert _refused(res, "config file not found"), res.stderr


def test_data_check_with_a_config_checks_what_training_checks(tiny_dir):
    plain = run_cli("data", "check", tiny_dir / "rl.parquet")
    assert plain.returncode == 0, plain.stderr
    good = run_cli("data", "check", tiny_dir / "rl.parquet", "--config", ROOT / "deploy/tiny.yaml",
                   "--model", tiny_dir / "model")
    assert good.returncode == 0 and "ok:" in good.stdout, good.stderr
    # a stop token the tokenizer splits: the data alone is fine, training with this config is not
    bad = run_cli("data", "check", tiny_dir / "rl.parquet", "--config", ROOT / "deploy/tiny.yaml",
                  "--model", tiny_dir / "model", "--set", "rollout.extra_stop_tokens=['two words']")
    assert _refused(bad, "rollout.extra_stop_tokens: expected 'two words' to be one token"), bad.stderr
    assert _refused(run_cli("data", "check", tiny_dir / "rl.parquet", "--set", "grpo.steps=3"), "--set needs --config")


def test_training_and_data_check_render_the_same_prompt_table(tiny_dir):
    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.model_checks import load_tokenizer
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.data import read_rows
    from nla_grpo.shared.prompts import prompt_table
    from nla_grpo.shared.spec import load_spec, sidecar_path

    cfg = build_config({"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
                        "rollout": {"prefill": "<explanation>"}}, "t")
    job = prepare_job(cfg, log=lambda m: None)
    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    table, (idx,) = prompt_table([job.train], load_tokenizer(tiny_dir / "model"), spec, "<explanation>", "t")
    assert table == job.prompt_ids[: len(table)] and (idx == job.prompt_index_train).all()
    rows = read_rows(tiny_dir / "rl.parquet", spec.d_model, max_rows=4)
    rows.prompts[2] = [{"role": "user", "content": "no marker here"}]
    import pytest

    from nla_grpo.shared.errors import NlaInputError

    with pytest.raises(NlaInputError, match=r"t: row 2, column 'prompt'"):
        prompt_table([rows], load_tokenizer(tiny_dir / "model"), spec, "", "t")


def test_config_check_off_the_node_checks_the_schema_and_rules_and_says_what_it_skipped():
    """Where neither the model nor the data is on this machine (a laptop before `ray job submit`), every shipped GPU
    config passes its schema and rules with one line naming what was not checked; a broken rule is still refused."""
    for name in ("colocated.yaml", "grpo.yaml", "grpo-2gpu.yaml", "grpo-4gpu.yaml"):
        res = run_cli("config", "check", ROOT / "deploy" / name)
        assert res.returncode == 0, (name, res.stderr)
        line, = res.stdout.strip().splitlines()
        assert line.startswith("ok (schema and cross-field rules): ") and name in line, line
        assert "not checked, not on this machine: model.path /models/Qwen3-8B" in line, line
    res = run_cli("config", "check", ROOT / "deploy/grpo.yaml", "--set", "placement.learner_gpus=0")
    assert _refused(res, "placement.learner_gpus"), res.stderr
    res = run_cli("config", "check", ROOT / "deploy/colocated.yaml", "--gpu-gib", "80")
    assert _refused(res, "--gpu-gib: the memory plan reads the model's config.json"), res.stderr
