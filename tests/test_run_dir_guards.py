"""Run-directory guards: one writer at a time, resume only forward, stray checkpoint copies ignored,
configs read as people write them."""
import json
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_cli
from nla_grpo.orchestrator.run_dir import RunDir
from nla_grpo.shared.config import build_config, load_config
from nla_grpo.shared.errors import NlaInputError


@pytest.fixture(scope="module")
def four_step_run(tiny_dir, tmp_path_factory):
    """One 4-step tiny run (checkpoints at steps 2 and 4, a frozen critic), trained once for the
    module; each test resumes its own copy (``_copy``)."""
    run = tmp_path_factory.mktemp("four") / "run"
    res = run_cli("train", ROOT / "deploy/tiny.yaml", "--run-dir", run, "--steps", "4", "--set", f"model.path={tiny_dir / 'model'}",
                  "--set", f"data.parquet={tiny_dir / 'rl.parquet'}", "--set", "checkpointing.every=2",
                  "--set", "critic.train=false", "--set", "logging.eval_every=0", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    # a quiet start: what the user needs (data, run, services, the push), not the libraries' warnings and bars
    before = (res.stdout + res.stderr).split("step     1/4")[0].splitlines()
    noise = [l for l in before if "WARNING" in l or "Warning" in l or "it/s]" in l]
    assert noise == [] and "[push] adapter v1" in res.stdout, noise
    # what the engine runs, once: vLLM on the CPU (its V1 runner there), through prompt embeddings (rollout.vector_input auto's route on the CPU)
    engine = [l for l in res.stdout.splitlines() if l.startswith("[engine] ")]
    assert len(engine) == 1 and engine[0].startswith("[engine] vLLM ") and "V1 model runner" in engine[0], engine
    assert "through prompt embeddings" in engine[0] and "prefix caching on" in engine[0], engine
    return run


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _run_dir(tiny_dir, path, steps=4):
    cfg = build_config({"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
                        "grpo": {"steps": steps}}, "t")
    return RunDir.create(path, cfg)


def test_a_second_writer_is_refused_with_the_holders_pid(tiny_dir, tmp_path):
    run = _run_dir(tiny_dir, tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); "
                               f"from orchestrator.run_dir import RunDir; RunDir({str(run.path)!r}).lock(); "
                               "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        res = run_cli("train", "--resume", run.path, "--steps", "6", timeout=120)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        lines = [l for l in res.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and f"in use by pid {holder.pid} on " in lines[0], res.stderr
        with pytest.raises(NlaInputError, match=f"pid {holder.pid}"):
            RunDir(run.path).lock()
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    RunDir(run.path).lock()  # the holder's lock went with its process


def test_resume_only_moves_forward_and_ignores_stray_copies(tiny_dir, tmp_path):
    run = _run_dir(tiny_dir, tmp_path / "run", steps=4)
    for name in ("step_000004", "step_000004.bak", "step_00002"):
        for part in ("state.json", "policy/learner_state.json", "critic/critic_meta.json"):
            (run.checkpoints / name / part).parent.mkdir(parents=True, exist_ok=True)
            (run.checkpoints / name / part).write_text('{"step": 4}')
    assert [p.name for p in run.list_checkpoints()] == ["step_000004"]
    before = (run.path / "config.yaml").read_text()
    for steps in ([], ["--steps", "3"], ["--steps", "4"]):
        res = run_cli("train", "--resume", run.path, *steps, timeout=120)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "already at step 4" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert (run.path / "config.yaml").read_text() == before  # nothing rewritten


def test_scientific_notation_and_empty_files(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("learner:\n  lr: 3e-3\ncritic:\n  lr: 1E-5\n")
    cfg = load_config(p, ["grpo.adv_eps=1e-7"])
    assert cfg.learner.lr == 3e-3 and cfg.critic.lr == 1e-5 and cfg.grpo.adv_eps == 1e-7
    p.write_text("")
    with pytest.raises(NlaInputError, match="empty config file"):
        load_config(p)
    p.write_text("# only a comment\n")
    with pytest.raises(NlaInputError, match="empty config file"):
        load_config(p)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_damaged_newest_checkpoint_is_skipped_and_named(four_step_run, tmp_path):
    """Each damage is found before anything starts (a cut JSON file, a truncated safetensors file); the
    resume then runs from the previous complete checkpoint."""
    run = _copy(four_step_run, tmp_path)
    newest = run / "checkpoints" / "step_000004"
    f = newest / "state.json"
    intact = f.read_text()
    f.write_text(intact[:10])
    said = []
    assert RunDir(run).loadable_checkpoint(log=said.append).name == "step_000002"
    assert len(said) == 1 and said[0].startswith("[resume] skipping step_000004: ") and "state.json" in said[0], said
    f.write_text(intact)
    assert RunDir(run).loadable_checkpoint(log=said.append).name == "step_000004" and len(said) == 1

    f = newest / "policy" / "optimizer.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    res = run_cli("train", "--resume", run, "--steps", "6", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    skipped = [l for l in res.stdout.splitlines() if l.startswith("[resume] skipping step_000004: ")]
    assert len(skipped) == 1 and f.name in skipped[0] and "damaged" in skipped[0], res.stdout[-2000:]
    assert "[resume] from" in res.stdout and "step_000002: 2 steps done, continuing with step 3" in res.stdout
    rows = [l for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6  # steps 2 and 3 redone from the complete checkpoint, then 4 and 5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_refuses_a_changed_config_naming_the_field(four_step_run, tmp_path):
    import yaml

    run = _copy(four_step_run, tmp_path)
    original = (run / "config.yaml").read_text()
    for section, key, value in (("learner", "lr", 1.0e-4), ("learner", "lora_r", 16), ("data", "max_rows", 100)):
        raw = yaml.safe_load(original)
        raw[section][key] = value
        (run / "config.yaml").write_text(yaml.safe_dump(raw))
        res = run_cli("train", "--resume", run, "--steps", "6", timeout=300)
        assert res.returncode == 2 and "Traceback" not in res.stderr and "[ray]" not in res.stdout, res.stderr[-2000:]
        assert f"{section}.{key}: " in res.stderr and "when the checkpoint was written" in res.stderr, res.stderr
    # on purpose, on the command line: the learning rate may change, the structure may not
    (run / "config.yaml").write_text(original)
    res = run_cli("train", "--resume", run, "--steps", "6", "--set", "learner.lora_r=4", timeout=120)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        res.stderr.strip()] and "--set: learner.lora_r: cannot change when a run resumes" in res.stderr, res.stderr
    raw = yaml.safe_load(original)
    raw["logging"]["every"] = 2  # what a run logs may change, in the file
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    res = run_cli("train", "--resume", run, "--steps", "5", "--set", "learner.lr=1e-3", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["learner"]["lr"] == 1e-3 and saved["logging"]["every"] == 2 and saved["grpo"]["steps"] == 5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoints_point_at_frozen_parts_instead_of_copying_them(four_step_run, tmp_path):
    """A frozen critic and the reference adapter are not copied into each checkpoint: the reference
    is written once into the run directory, each checkpoint records SHA-256s; resume uses them, and a
    frozen file that changed is refused in one line."""
    run = _copy(four_step_run, tmp_path)
    for step in (2, 4):
        ckpt = run / "checkpoints" / f"step_{step:06d}"
        assert (ckpt / "critic.json").is_file() and not (ckpt / "critic").exists()
        assert (ckpt / "policy" / "reference.json").is_file() and not (ckpt / "policy" / "reference").exists()
        assert json.loads((ckpt / "critic.json").read_text())["source"] == "model"
    assert (run / "frozen" / "reference" / "adapter_model.safetensors").is_file()
    res = run_cli("train", "--resume", run, "--steps", "5", timeout=600)
    assert res.returncode == 0 and "step_000004: 4 steps done, continuing with step 5" in res.stdout, res.stderr[-2000:]
    f = run / "frozen" / "reference" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    res = run_cli("train", "--resume", run, "--steps", "6", timeout=120)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "no loadable checkpoint" in err[0] and "policy/reference.json: the frozen file it references has changed" in err[0]


def test_a_checkpoint_written_before_newer_fields_still_resumes(tmp_path):
    """Fields added since a checkpoint was written take their defaults (what that version did): its
    config misses them, yet the resume is not refused; a field it did record is still compared."""
    from types import SimpleNamespace

    from nla_grpo.orchestrator.job import _resolve, check_resume

    def job_config(raw):  # as prepare_job hands it to check_resume: resolved (no prompts, no critic checkpoint here)
        return _resolve(build_config(raw, "t"), [], (None, None))

    cfg = job_config({"critic": {"add_bos": False}})
    saved = cfg.model_dump(mode="json")
    for section, key in (("data", "order"), ("data", "eval_skip_rows"), ("critic", "add_bos")):
        del saved[section][key]
    del saved["evals"]
    ckpt = tmp_path / "step_000004"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"step": 4, "config": saved}))
    job = SimpleNamespace(data_fingerprint=None, prompt_ids=[])
    check_resume(ckpt, cfg, job, tmp_path / "config.yaml")
    # an older run's critic encoded without a start token: resuming it with one is a change
    with pytest.raises(NlaInputError, match=r"critic.add_bos: False when the checkpoint was written, None now"):
        check_resume(ckpt, job_config({}), job, tmp_path / "config.yaml")
    with pytest.raises(NlaInputError, match=r"learner.lr: 0.0001 when the checkpoint was written"):
        saved["learner"]["lr"] = 1e-4
        (ckpt / "state.json").write_text(json.dumps({"step": 4, "config": saved}))
        check_resume(ckpt, cfg, job, tmp_path / "config.yaml")
