"""``shared.resolve``: every ``auto`` of the run config becomes a value in one module, and a run keeps the result."""
import re
from pathlib import Path

import pytest
import yaml

from nla_grpo.shared.config import build_config
from nla_grpo.shared.resolve import STAYS_AUTO, resolve_job

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "dataprep", "sft", "rollout", "critic", "learner", "orchestrator", "evals", "nla_grpo")


def _autos(tree: dict, prefix: str = "") -> set[str]:
    """Dotted paths of the fields whose value is still ``auto``."""
    out = set()
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _autos(value, f"{prefix}{key}.")
        elif value == "auto":
            out.add(prefix + key)
    return out


def test_the_job_time_values_are_taken_from_the_facts_and_never_over_a_set_value(tiny_dir):
    cfg = build_config({"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
                        "placement": {"mode": "cpu"}})
    got = resolve_job(cfg, 41, (8, 16))
    assert got == {"rollout": {"vector_input": "prompt_embeds", "max_prompt_tokens": 41},
                   "logging": {"eval_at_start": False}, "critic": {"lora_r": 8, "lora_alpha": 16}}
    warm = cfg.model_copy(update={"critic": cfg.critic.model_copy(update={"checkpoint": "somewhere"})})
    assert resolve_job(warm, 41, (8, 16))["logging"] == {"eval_at_start": True}  # a warm start evaluates as step 0
    fixed = build_config({"model": {"path": str(tiny_dir / "model")}, "placement": {"mode": "cpu"},
                          "rollout": {"vector_input": "prompt_embeds", "max_prompt_tokens": 99},
                          "logging": {"eval_at_start": True}, "critic": {"lora_r": 4, "lora_alpha": 4}})
    assert resolve_job(fixed, 41, (8, 16)) == {}
    assert "max_prompt_tokens" not in resolve_job(cfg, None, None).get("rollout", {})  # no prompts: nothing to size for


def test_a_prepared_job_leaves_auto_only_where_it_is_a_policy(tiny_dir):
    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.config import load_config

    cfg = load_config(ROOT / "deploy/tiny.yaml", [f"model.path={tiny_dir / 'model'}", f"data.parquet={tiny_dir / 'rl.parquet'}"])
    assert {"rollout.vector_input", "logging.eval_at_start"} <= _autos(cfg.model_dump(mode="json"))
    job = prepare_job(cfg, log=lambda m: None)
    left = _autos(job.cfg.model_dump(mode="json"))
    assert left <= set(STAYS_AUTO), left - set(STAYS_AUTO)
    assert job.cfg.rollout.max_prompt_tokens == max(len(ids) for ids, _ in job.prompt_ids)


def test_a_run_directory_keeps_the_config_it_ran(six_step_run):
    saved = yaml.safe_load((six_step_run / "config.yaml").read_text())
    left = _autos(saved)
    assert left <= set(STAYS_AUTO), left - set(STAYS_AUTO)
    assert saved["rollout"]["vector_input"] == "prompt_embeds" and saved["rollout"]["max_prompt_tokens"] > 8


# a field's auto compared outside shared/resolve.py: `x.field == "auto"` / `!= "auto"` (a command's own
# `args.x` is not a config field)
AUTO_TEST = re.compile(r"(\w+)\.(\w+)\s*[!=]=\s*[\"']auto[\"']")


def test_only_the_resolver_decides_an_auto_that_is_not_a_policy():
    """Elsewhere, a config field is compared with ``auto`` only where its ``auto`` is a policy (``STAYS_AUTO``)."""
    policies = {path.split(".")[-1] for path in STAYS_AUTO}
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "shared" / "resolve.py":
                continue
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                found += [f"{path.relative_to(ROOT)}:{lineno}: {m.group(2)}" for m in AUTO_TEST.finditer(line)
                          if m.group(1) != "args" and m.group(2) not in policies]
    assert not found, found


@pytest.mark.parametrize("field", ["rollout.lora", "weight_sync.kind"])
def test_config_time_values_come_resolved_from_every_load(tiny_dir, field):
    cfg = build_config({"model": {"path": str(tiny_dir / "model")}, "placement": {"mode": "cpu"}})
    section, key = field.split(".")
    assert getattr(getattr(cfg, section), key) != "auto"


def test_a_checkpoint_saved_with_auto_resumes_under_the_resolved_config(tiny_dir, tmp_path):
    """A run whose checkpoint recorded ``auto`` (before the job resolved it) resumes: its config is resolved with
    this job's facts before the comparison; a value it did fix is still compared."""
    import json
    from types import SimpleNamespace

    from nla_grpo.orchestrator.job import _resolve, check_resume
    from nla_grpo.shared.errors import NlaInputError

    raw = {"model": {"path": str(tiny_dir / "model")}, "placement": {"mode": "cpu"}}
    prompts = [([1] * 30, None), ([1] * 41, None)]
    now = _resolve(build_config(raw), prompts, (None, None))
    assert now.rollout.vector_input == "prompt_embeds" and now.rollout.max_prompt_tokens == 41
    ckpt = tmp_path / "step_000002"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"step": 2, "config": build_config(raw).model_dump(mode="json")}))
    job = SimpleNamespace(data_fingerprint=None, prompt_ids=prompts)
    check_resume(ckpt, now, job, tmp_path / "config.yaml")
    fixed = build_config({**raw, "rollout": {"max_prompt_tokens": 64}}).model_dump(mode="json")
    (ckpt / "state.json").write_text(json.dumps({"step": 2, "config": fixed}))
    with pytest.raises(NlaInputError, match=r"rollout.max_prompt_tokens: 64 when the checkpoint was written, 41 now"):
        check_resume(ckpt, now, job, tmp_path / "config.yaml")
