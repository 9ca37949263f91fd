"""The SFT stages end to end on the tiny model (real Ray rank actors, the CLI as a user runs it), on
explained splits whose explanation is each row's topic: AV-SFT lowers the held-out NLL and a killed run
resumes to the straight run's adapter, bit for bit; AR-SFT beats the dataset's FVE baseline on held-out
documents; RL takes both products as they are; bad inputs are one line and exit 2."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

AV = ["--set", "sft.av.batch_tokens=512", "--set", "sft.av.lr=1e-2", "--set", "sft.av.eval_every=4",
      "--set", "sft.av.checkpoint_every=2", "--set", "sft.av.steps=8",
      # what the deploy configs hold: the RL run's paths to this stage's products, which a stage never starts from
      "--set", "learner.adapter_init=/nonexistent/sft_av/adapter", "--set", "critic.checkpoint=/nonexistent/sft_ar/critic"]


@pytest.fixture(scope="module")
def explained(tiny_dir, tmp_path_factory):
    """``av_sft`` / ``ar_sft`` explained splits (the tiny RL rows, each explained by its topic) beside an RL
    parquet, as `data explain` lays them out."""
    d = tmp_path_factory.mktemp("explained")
    table = pq.read_table(tiny_dir / "rl.parquet")
    topics = json.loads((tiny_dir / "topics.json").read_text())
    meta = yaml.safe_load((tiny_dir / "rl.parquet.nla_meta.yaml").read_text())
    meta["extraction"]["base_model"] = str(tiny_dir / "model")
    shutil.copy(tiny_dir / "rl.parquet", d / "rl.parquet")
    (d / "rl.parquet.nla_meta.yaml").write_text(yaml.safe_dump(meta, allow_unicode=True))
    for split in ("av_sft", "ar_sft"):
        pq.write_table(table.append_column("explanation", pa.array([f"{t} words" for t in topics])),
                       d / f"{split}.explained.parquet")
        side = dict(meta, explanations={"teacher_model": "topics", "prompt_version": 1})
        (d / f"{split}.explained.parquet.nla_meta.yaml").write_text(yaml.safe_dump(side, allow_unicode=True))
    return d


def data_args(tiny_dir, explained):
    return ["--set", f"model.path={tiny_dir / 'model'}", "--set", f"data.parquet={explained / 'rl.parquet'}"]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _adapter(run):
    from safetensors.torch import load_file

    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def straight_av(tiny_dir, explained, tmp_path_factory):
    run = tmp_path_factory.mktemp("av") / "straight"
    res = run_cli("sft", "av", ROOT / "deploy/tiny.yaml", "--run-dir", run, *data_args(tiny_dir, explained), *AV, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def test_av_sft_lowers_the_held_out_nll_and_rl_takes_its_adapter(straight_av, tiny_dir, explained):
    rows = _metrics(straight_av)
    evals = [r["eval/nll"] for r in rows if "eval/nll" in r]
    assert rows[0]["step"] == 0 and len(evals) == 3  # before training, at step 4 and at the end
    assert evals[-1] < 0.5 * evals[0], evals
    assert all(k in rows[-1] for k in ("loss", "lr", "grad_norm", "sft/tokens_per_s", "sft/tflops_executed"))
    assert (straight_av / "plots" / "curves.png").is_file()
    from nla_grpo.orchestrator.plot import SFT_PANELS, panels_for

    assert panels_for(rows) is SFT_PANELS and all(any(k in r for r in rows for k in keys) for t, keys in SFT_PANELS
                                                  if "AR" not in t)
    product = straight_av / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json", "nla_injection.json", "nla_sft.json"} <= {
        p.name for p in product.iterdir()}
    # the RL config takes it as it is, as the policy's start and the KL reference
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *data_args(tiny_dir, explained),
                  "--set", f"learner.adapter_init={product}")
    assert res.returncode == 0, res.stderr[-2000:]
    # ... and refuses it, in one line, under another injection than it was trained with
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *data_args(tiny_dir, explained),
                  "--set", f"learner.adapter_init={product}", "--set", "injection.scale=2.5")
    assert res.returncode == 2 and "nla_injection.json" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    # ... and under another LoRA rank than it has
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *data_args(tiny_dir, explained),
                  "--set", f"learner.adapter_init={product}", "--set", "learner.lora_r=16")
    assert res.returncode == 2 and "lora_r" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_killed_av_sft_resumes_to_the_straight_runs_adapter(straight_av, tiny_dir, explained, tmp_path):
    run = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "nla_grpo.orchestrator.cli", "sft", "av", str(ROOT / "deploy/tiny.yaml"),
                             "--run-dir", str(run), *data_args(tiny_dir, explained), *AV], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "checkpoints" / "step_000004").is_dir():
        assert proc.poll() is None, "the stage ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Ray, at once
    proc.wait()
    assert not (run / "adapter").exists()
    res = run_cli("sft", "av", "--resume", run, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _adapter(straight_av), _adapter(run)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    straight = {r["step"]: r["loss"] for r in _metrics(straight_av) if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in _metrics(run) if "loss" in r}
    assert resumed == straight  # one line per step, none twice, the same losses

    # a finished stage: the same count is nothing to do; fewer steps, a changed field or a longer cosine
    # schedule are refused in one line, and the run directory's config stays as it was
    config = (run / "config.yaml").read_text()
    res = run_cli("sft", "av", "--resume", run, "--steps", "8")
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr[-2000:]
    for extra, words in ((["--steps", "4"], ("already at step 8",)), (["--set", "sft.av.lr=0.5"], ("sft.av.lr", "exactly")),
                         (["--steps", "12"], ("cosine", "planned for 8"))):
        res = run_cli("sft", "av", "--resume", run, *extra)
        _one_line(res, *words)
        assert (run / "config.yaml").read_text() == config
    res = run_cli("sft", "ar", "--resume", run)
    _one_line(res, "sft av")


def test_ar_sft_beats_the_fve_baseline_on_held_out_documents_and_rl_takes_it(tiny_dir, explained, tmp_path):
    run = tmp_path / "ar"
    res = run_cli("sft", "ar", ROOT / "deploy/tiny.yaml", "--run-dir", run, *data_args(tiny_dir, explained),
                  "--set", "critic.checkpoint=/nonexistent/sft_ar/critic",
                  "--set", "sft.ar.batch_tokens=512", "--set", "sft.ar.lr=1e-3", "--set", "sft.ar.steps=30",
                  "--set", "sft.ar.eval_every=0", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _metrics(run)
    assert rows[0]["eval/fve"] < 0 and rows[-1]["eval/fve"] > 0.2, (rows[0], rows[-1])
    assert (run / "critic" / "critic_meta.json").is_file()
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *data_args(tiny_dir, explained),
                  "--set", f"critic.checkpoint={run / 'critic'}", "--set", "critic.lora_r=null")
    assert res.returncode == 0, res.stderr[-2000:]
    # a critic of another structure than the checkpoint is refused in one line
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", *data_args(tiny_dir, explained),
                  "--set", f"critic.checkpoint={run / 'critic'}", "--set", "critic.lora_r=8")
    assert res.returncode == 2 and "lora_r" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def _one_line(res, *words):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), res.stderr


def test_bad_inputs_are_one_line_and_leave_no_run_directory(tiny_dir, explained, tmp_path):
    run = tmp_path / "run"
    # splits without explanations (the extracted split itself)
    res = run_cli("sft", "av", ROOT / "deploy/tiny.yaml", "--run-dir", run, *data_args(tiny_dir, explained),
                  "--set", f"sft.av.data={explained / 'rl.parquet'}")
    _one_line(res, "explanation", "data explain")
    # no explained split where the config points
    res = run_cli("sft", "ar", ROOT / "deploy/tiny.yaml", "--run-dir", run, *data_args(tiny_dir, explained),
                  "--set", f"sft.ar.data={tmp_path / 'missing.parquet'}")
    _one_line(res, "missing.parquet", "data explain")
    # a split of another layer than the RL data's
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(explained / "av_sft.explained.parquet", other / "av_sft.explained.parquet")
    meta = yaml.safe_load((explained / "av_sft.explained.parquet.nla_meta.yaml").read_text())
    meta["extraction"]["layer_index"] = 1
    (other / "av_sft.explained.parquet.nla_meta.yaml").write_text(yaml.safe_dump(meta, allow_unicode=True))
    res = run_cli("sft", "av", ROOT / "deploy/tiny.yaml", "--run-dir", run, *data_args(tiny_dir, explained),
                  "--set", f"sft.av.data={other / 'av_sft.explained.parquet'}")
    _one_line(res, "layer_index", "same model and layer")
    # a field the schema does not know
    res = run_cli("sft", "av", ROOT / "deploy/tiny.yaml", "--run-dir", run, *data_args(tiny_dir, explained),
                  "--set", "sft.av.batch_tokenz=3")
    _one_line(res, "sft.av.batch_tokenz", "unknown key")
    assert not run.exists()


def test_two_ranks_train_what_one_rank_trains(tiny_dir, explained, tmp_path):
    """Each stage's data-parallel rank group: two ranks deal a step's micro-batches between them and sum
    the gradients, so they end where one rank ends, to fp32 rounding (one rank sums in fp32 as autograd
    does, two in float64)."""
    from safetensors.torch import load_file

    from conftest import run_cli_together

    common = ["sft", "av", ROOT / "deploy/tiny.yaml", *data_args(tiny_dir, explained), *AV, "--set", "learner.micro_batch=4"]
    ar = ["sft", "ar", ROOT / "deploy/tiny.yaml", *data_args(tiny_dir, explained), "--set", "sft.ar.batch_tokens=512",
          "--set", "sft.ar.lr=1e-3", "--set", "sft.ar.steps=6", "--set", "critic.micro_batch=4"]
    runs = run_cli_together([*common, "--run-dir", tmp_path / "av1"],
                            [*common, "--run-dir", tmp_path / "av2", "--set", "placement.learner_workers=2"], timeout=900)
    runs += run_cli_together([*ar, "--run-dir", tmp_path / "ar1"],
                             [*ar, "--run-dir", tmp_path / "ar2", "--set", "placement.critic_workers=2"], timeout=900)
    for res in runs:
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = _adapter(tmp_path / "av1"), _adapter(tmp_path / "av2")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    c, d = (load_file(str(tmp_path / r / "critic" / "critic_weights.safetensors")) for r in ("ar1", "ar2"))
    assert c.keys() == d.keys() and max((c[k] - d[k]).abs().max().item() for k in c) <= 1e-5
    for one, two in (("av1", "av2"), ("ar1", "ar2")):
        x, y = _metrics(tmp_path / one), _metrics(tmp_path / two)
        assert [r["step"] for r in x] == [r["step"] for r in y]
        assert all(r["loss"] == pytest.approx(s["loss"], rel=1e-5) for r, s in zip(x, y) if "loss" in r)
