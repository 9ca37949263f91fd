"""``nla-grpo pipeline deploy/pipeline-tiny.yaml`` end to end on the CPU, its teacher a real HTTP server on
loopback speaking OpenAI's chat completions: the tiny fixture, extraction, explanations, AV-SFT, AR-SFT and
RL from their products each write their output under the run directory; run again, every stage is
skipped and the teacher is asked nothing; a pipeline without a teacher is one line."""
import json

import pytest

from conftest import ROOT, run_cli
from teacher_server import TeacherServer

pytestmark = pytest.mark.slow

SMALL = ["--set", "train.steps=3", "--set", "extract.positions_per_doc=2",
         "--set", "set=[injection.scale=embed_norm,sft.av.steps=6,sft.av.batch_tokens=1024,sft.ar.steps=6,"
                  "sft.ar.batch_tokens=512,logging.eval_every=0,checkpointing.every=0]"]


def test_the_tiny_pipeline_runs_every_stage_then_skips_them(tmp_path):
    out = tmp_path / "pipe"
    with TeacherServer() as teacher:
        args = ["pipeline", ROOT / "deploy/pipeline-tiny.yaml", "--run-dir", out,
                "--set", f"explain.base_url={teacher.url}", "--set", "explain.model=teacher", *SMALL]
        res = run_cli(*args, timeout=900)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        asked = sum(teacher.seen.values())
        assert asked == sum(teacher.answered.values()) > 0  # every row asked once, none again
        for path in ("tiny/model/config.json", "data/rl.parquet", "data/av_sft.explained.parquet",
                     "data/ar_sft.explained.parquet", "sft_av/adapter/adapter_model.safetensors",
                     "sft_ar/critic/critic_meta.json", "rl/config.yaml"):
            assert (out / path).is_file(), path
        rl = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rl] == [0, 1, 2]
        config = (out / "rl" / "config.yaml").read_text()
        assert str(out / "sft_av" / "adapter") in config and str(out / "sft_ar" / "critic") in config
        sidecar = (out / "data" / "av_sft.explained.parquet.nla_meta.yaml").read_text()
        assert "teacher_model: teacher" in sidecar and "prompt_version" in sidecar

        again = run_cli(*args, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert sum(teacher.seen.values()) == asked
        for stage in ("tiny fixture", "extract", "sft av", "sft ar", "train"):
            assert f"[pipeline] {stage}: " in again.stdout and "skipped" in again.stdout.split(f"[pipeline] {stage}: ")[1].splitlines()[0]


def test_a_pipeline_without_a_teacher_is_one_line(tmp_path):
    res = run_cli("pipeline", ROOT / "deploy/pipeline-tiny.yaml", "--run-dir", tmp_path / "p")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "explain.base_url" in lines[0], res.stderr
    assert not (tmp_path / "p").exists()
