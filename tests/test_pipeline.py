"""``nla-grpo pipeline deploy/pipeline-tiny.yaml`` end to end on the CPU, its teacher a real HTTP server on
loopback speaking OpenAI's chat completions (it names the marked token: a deterministic function of the
prompt). The tiny fixture, extraction, explanations, AV-SFT, AR-SFT and 100 RL steps from their products
each write their output under the run directory; AR-SFT beats the dataset's FVE baseline on held-out
documents; RL from the SFT products starts above RL from scratch on the same data and seed, and still
rises; run again, every stage is skipped and the teacher is asked nothing; without a teacher, one line."""
import json

import pytest

from conftest import ROOT, run_cli, run_cli_together
from teacher_server import TeacherServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the whole pipeline runs in the first test

WINDOW = 25


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe") / "run"
    with TeacherServer(token_only=True) as teacher:
        args = ["pipeline", ROOT / "deploy/pipeline-tiny.yaml", "--run-dir", out,
                "--set", f"explain.base_url={teacher.url}", "--set", "explain.model=teacher"]
        res = run_cli(*args, timeout=1800)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        yield out, teacher, args


def test_every_stage_writes_its_output_and_learns(pipeline, tmp_path):
    out, teacher, _ = pipeline
    asked = sum(teacher.seen.values())
    assert asked == sum(teacher.answered.values()) > 0  # every row asked once, none again
    for path in ("tiny/subject/config.json", "data/rl.parquet", "data/av_sft.explained.parquet",
                 "data/ar_sft.explained.parquet", "sft_av/adapter/adapter_model.safetensors",
                 "sft_ar/critic/critic_meta.json", "rl/config.yaml"):
        assert (out / path).is_file(), path
    sidecar = (out / "data" / "av_sft.explained.parquet.nla_meta.yaml").read_text()
    assert "teacher_model: teacher" in sidecar and "prompt_version" in sidecar
    av = [r for r in _metrics(out / "sft_av" / "metrics.jsonl") if "eval/nll" in r]
    assert av[-1]["eval/nll"] < 0.25 * av[0]["eval/nll"], av
    ar = [r for r in _metrics(out / "sft_ar" / "metrics.jsonl") if "eval/fve" in r]
    assert ar[0]["eval/fve"] < 0 < 0.2 < ar[-1]["eval/fve"], ar
    config = (out / "rl" / "config.yaml").read_text()
    assert str(out / "sft_av" / "adapter") in config and str(out / "sft_ar" / "critic") in config

    # RL from scratch on the same data, model and seed: the pipeline's run config without the SFT products
    scratch = tmp_path / "scratch"
    (res,) = run_cli_together(["train", ROOT / "deploy/tiny.yaml", "--run-dir", scratch, "--steps", "100",
                               "--set", f"model.path={out / 'tiny' / 'subject'}",
                               "--set", f"data.parquet={out / 'data' / 'rl.parquet'}",
                               "--set", "injection.scale=sqrt_d_model", "--set", "learner.lora_r=32",
                               "--set", "logging.eval_every=25", "--set", "checkpointing.every=0"], timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    rl, base = _metrics(out / "rl" / "metrics.jsonl"), _metrics(scratch / "metrics.jsonl")
    assert len(rl) == len(base) == 100
    first, last, scratch_first = _mean(rl[:WINDOW], "fve"), _mean(rl[-WINDOW:], "fve"), _mean(base[:WINDOW], "fve")
    assert first > scratch_first + 0.05, (first, scratch_first)
    assert last > first + 0.05, (first, last)


def test_a_second_run_skips_every_stage_and_asks_nothing(pipeline):
    out, teacher, args = pipeline
    asked = sum(teacher.seen.values())
    again = run_cli(*args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sum(teacher.seen.values()) == asked
    for stage in ("tiny fixture", "extract", "sft av", "sft ar", "train"):
        line = again.stdout.split(f"[pipeline] {stage}: ")[1].splitlines()[0]
        assert "skipped" in line, line
    assert "[explain] av_sft" in again.stdout and "already" in again.stdout


def test_a_pipeline_without_a_teacher_is_one_line(tmp_path):
    res = run_cli("pipeline", ROOT / "deploy/pipeline-tiny.yaml", "--run-dir", tmp_path / "p")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "explain.base_url" in lines[0], res.stderr
    assert not (tmp_path / "p").exists()
