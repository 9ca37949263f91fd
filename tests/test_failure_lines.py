"""Stopping a run from outside (Ctrl-C, SIGTERM) and a bad LoRA target: one line each, no traceback,
and the run directory still resumes."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _data(tiny_dir):
    return ["--set", f"model.path={tiny_dir / 'model'}", "--set", f"data.parquet={tiny_dir / 'rl.parquet'}"]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_with_one_line_and_it_resumes(tiny_dir, tmp_path, sig, code):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "orchestrator.cli", "train", str(ROOT / "deploy/tiny.yaml"), "--run-dir", str(run),
           "--steps", "400", *_data(tiny_dir), "--set", "logging.eval_every=0", "--set", "checkpointing.every=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics, deadline = run / "metrics.jsonl", time.time() + 600
    while proc.poll() is None and time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-3000:]
    lines = [l for l in err.splitlines() if l.startswith("nla-grpo: error")]
    assert len(lines) == 1 and f"interrupted ({signal.Signals(sig).name})" in lines[0], err[-3000:]
    assert "Traceback" not in err and "Stack trace" not in err and "*** SIG" not in err, err[-3000:]
    res = run_cli("train", "--resume", run, "--steps", "6", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[resume] from" in res.stdout


def test_a_bad_lora_target_stops_before_any_actor(tiny_dir, tmp_path):
    res = run_cli("train", ROOT / "deploy/tiny.yaml", "--run-dir", tmp_path / "r", *_data(tiny_dir),
                  "--set", "learner.target_modules=[q_proj,bogus_proj]", timeout=300)
    assert res.returncode == 2 and "[ray]" not in res.stdout and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        res.stderr.strip()] and "learner.target_modules: ['bogus_proj'] not among the linear modules" in res.stderr
    assert not (tmp_path / "r").exists()
