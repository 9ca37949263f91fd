"""The judged evals: items chosen before any actor starts (and refused in one line when their inputs
are missing), what the judge is asked, failures counted as failures, and the tiny job with both evals
on, judged by a scripted server on loopback (``judge_server.JudgeServer``)."""
import json

import numpy as np
import pytest

from conftest import ROOT, run_cli
from nla_grpo.evals.judges import Judge
from nla_grpo.evals.tasks import EvalItem, HallucinationEval, KarvonenConfusionEval, run_evals
from judge_server import JudgeServer
from nla_grpo.shared.config import build_config
from nla_grpo.shared.errors import NlaInputError

KEY = "sk-judged-evals-secret-42"


def scripted(user: str) -> str:
    """The judge's answers: by what the explanation says."""
    explanation = user.split("Explanation:\n<<<\n", 1)[1].split("\n>>>", 1)[0]
    if "garbage" in explanation:
        return "I cannot decide."
    if "wrong shape" in explanation:
        return '{"unsupported_claims": "none", "captures_quirk": "maybe"}'
    if "unsupported_claims" in user:
        return json.dumps({"unsupported_claims": [w for w in explanation.split() if w.startswith("dragon")]})
    return json.dumps({"captures_quirk": "ocean" in explanation})


def _judge(url):
    cfg = build_config({"evals": {"judge": {"base_url": url + "/v1", "model": "judge", "api_key_env": "NLA_TEST_JUDGE_KEY"}}},
                       "t").evals.judge
    return Judge(cfg, sleep=lambda s: None)


def test_metrics_count_claims_and_quirks_and_never_pass_a_failure(monkeypatch):
    monkeypatch.setenv("NLA_TEST_JUDGE_KEY", KEY)
    vec = np.zeros(4, np.float32)
    hall = HallucinationEval([EvalItem(f"row-{i}", [1, 2, 3], 1, vec, {"text": "the sea and a ship", "row_id": i})
                              for i in range(5)])
    karv = KarvonenConfusionEval([EvalItem(f"rec-{i}", [1, 2, 3], 1, vec, {"quirk": "the text is about ocean",
                                                                        "distractor": "the text is about city"})
                                  for i in range(5)])
    said = ["sea ship", "dragon sea dragonfly", None, "garbage", "wrong shape"]
    with JudgeServer(reply_fn=scripted) as server:
        judge = _judge(server.url)
        metrics, records = run_evals([hall, karv], judge, lambda ev: said if ev is hall else
                                     ["ocean waves", "city streets", None, "garbage", "wrong shape"], step=7)
        judge.close()
    assert len(server.requests) == 8  # no judge call for a missing explanation
    assert metrics["eval/hallucination/hallucinations_mean"] == 1.0  # 0 and 2 claims over the 2 judged
    assert metrics["eval/hallucination/clean_rate"] == 0.5
    assert metrics["eval/hallucination/judge_failures"] == 2 and metrics["eval/hallucination/no_explanation"] == 1
    # 1 of the 2 answered captures it; the missing explanation captures nothing; failures are left out, not passed
    assert metrics["eval/karvonen_confusion/captures_quirk_rate"] == pytest.approx(1 / 3)
    assert metrics["eval/karvonen_confusion/judge_failures"] == 2
    by = {(r["eval"], r["item"]): r for r in records}
    assert by[("hallucination", "row-1")]["unsupported_claims"] == ["dragon", "dragonfly"]
    assert by[("hallucination", "row-3")]["judge_error"] == "no JSON object in the judge's reply"
    assert by[("karvonen_confusion", "rec-4")]["judge_error"] == "the reply has the wrong shape"
    assert all(r["step"] == 7 and "text" not in r for r in records)
    prompts = [r["body"]["messages"][1]["content"] for r in server.requests]
    assert any("the sea and a ship" in p and "<<<\nsea ship\n>>>" in p for p in prompts)  # the judge reads the source text
    # a judge that cannot be reached: every item a failure, no rate computed from nothing
    judge = _judge("http://127.0.0.1:9")
    judge.cfg = judge.cfg.model_copy(update={"retries": 0})
    metrics, _ = run_evals([karv], judge, lambda ev: ["ocean"] * 5, step=0)
    assert metrics["eval/karvonen_confusion/judge_failures"] == 5 and np.isnan(metrics["eval/karvonen_confusion/captures_quirk_rate"])


def test_eval_inputs_are_checked_before_any_actor(tiny_dir, tmp_path):
    import pyarrow.parquet as pq

    from nla_grpo.orchestrator.job import prepare_job

    base = {"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
            "evals": {"judge": {"model": "judge"}, "hallucination": {"enabled": True, "prompts": 4},
                      "karvonen_confusion": {"enabled": True, "records": str(tiny_dir / "karvonen_confusion.jsonl")}}}
    job = prepare_job(build_config(base, "t"), log=lambda m: None)
    hall, karv = job.evals
    assert len(hall.items) == 4 and all(it.context["text"] for it in hall.items) and len(karv.items) == 8
    assert not set(it.context["doc_id"] for it in hall.items) & set(job.train.doc_ids)  # held out
    # a parquet without the source text column
    table = pq.read_table(tiny_dir / "rl.parquet").drop(["detokenized_text_truncated"])
    pq.write_table(table, tmp_path / "rl.parquet")
    (tmp_path / "rl.parquet.nla_meta.yaml").write_bytes((tiny_dir / "rl.parquet.nla_meta.yaml").read_bytes())
    bad = {**base, "data": {"parquet": str(tmp_path / "rl.parquet")}}
    with pytest.raises(NlaInputError, match="evals.hallucination needs column 'detokenized_text_truncated'"):
        prepare_job(build_config(bad, "t"), log=lambda m: None)
    records = (tiny_dir / "karvonen_confusion.jsonl").read_text().splitlines()
    for n, (line, needle) in enumerate((
        (records[0].replace('"quirk"', '"quirks"'), "line 2, field 'quirk': expected a non-empty string"),
        (json.dumps({**json.loads(records[0]), "activation": [0.0] * 3}), "line 2, field 'activation': expected 64 finite numbers, found 3 values"),
        ("{not json", "line 2: not JSON"),
    )):
        path = tmp_path / f"records{n}.jsonl"
        path.write_text("\n".join([records[0], line]) + "\n")
        cfg = build_config({**base, "evals": {**base["evals"], "karvonen_confusion": {"enabled": True, "records": str(path)}}}, "t")
        with pytest.raises(NlaInputError, match=needle):
            prepare_job(cfg, log=lambda m: None)
    with pytest.raises(NlaInputError, match="evals.hallucination.enabled runs on the eval steps: set logging.eval_every"):
        build_config({**base, "logging": {"eval_every": 0}}, "t")
    with pytest.raises(NlaInputError, match="judge.model: needed by the enabled evals"):
        build_config({"evals": {"hallucination": {"enabled": True}}}, "t")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_tiny_job_with_both_evals_judged_on_loopback(tiny_dir, tmp_path, monkeypatch):
    """Eval metrics and records on each eval step and nowhere else, the Pareto plot, the key in no file
    of the run directory and in no line of the log; a judge that is down stops the run before anything
    starts. With wandb offline: the run's metrics, config, every eval table and its plots are recorded."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("NLA_TEST_JUDGE_KEY", KEY)
    args = ["train", ROOT / "deploy/tiny.yaml", "--steps", "4", "--set", f"model.path={tiny_dir / 'model'}",
            "--set", f"data.parquet={tiny_dir / 'rl.parquet'}", "--set", "logging.eval_every=2",
            "--set", "logging.eval_prompts=4", "--set", "checkpointing.every=0", "--set", "evals.judge.model=judge",
            "--set", "evals.judge.api_key_env=NLA_TEST_JUDGE_KEY", "--set", "evals.hallucination.enabled=true",
            "--set", "evals.hallucination.prompts=3", "--set", "evals.karvonen_confusion.enabled=true",
            "--set", f"evals.karvonen_confusion.records={tiny_dir / 'karvonen_confusion.jsonl'}",
            "--set", "evals.karvonen_confusion.prompts=4", "--set", "logging.wandb=offline"]
    res = run_cli(*args, "--run-dir", tmp_path / "down", "--set", "evals.judge.base_url=http://127.0.0.1:9/v1", timeout=300)
    assert res.returncode == 2 and "openai judge at http://127.0.0.1:9/v1 does not answer" in res.stderr, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1 and "[ray]" not in res.stdout and not (tmp_path / "down").exists()

    run = tmp_path / "run"
    with JudgeServer(reply_fn=scripted) as server:
        res = run_cli(*args, "--run-dir", run, "--set", f"evals.judge.base_url={server.url}/v1", timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    judged = {r["step"]: {k for k in r if k.startswith(("eval/hallucination/", "eval/karvonen_confusion/"))} for r in rows}
    assert judged[1] == judged[3] == set() and judged[2] == judged[4] and "eval/hallucination/clean_rate" in judged[2]
    assert "eval/karvonen_confusion/captures_quirk_rate" in judged[2]
    posts = [r for r in server.requests if r["path"].endswith("/chat/completions")]
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    judged_records = [r for r in records if r.get("eval") in ("hallucination", "karvonen_confusion")]
    assert len(judged_records) == 2 * (3 + 4)  # two eval steps
    assert len(posts) == sum(1 for r in judged_records if r["explanation"] is not None)  # no judge call elsewhere
    assert all(r["headers"]["Authorization"] == f"Bearer {KEY}" for r in posts)
    assert (run / "plots" / "pareto.png").is_file()
    for f in run.rglob("*"):
        if f.is_file():
            assert KEY.encode() not in f.read_bytes(), f
    assert KEY not in res.stdout + res.stderr and "[evals@2]" in res.stdout
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(run.rglob("*"))
    blob = files[0].read_bytes()  # wandb's record log stores keys and the config as plain protobuf strings
    for key in (b"reward_mean", b"fve", b"time/push", b"prompts_per_step", b"fve_pct", b"eval/samples",
                b"pareto/capability_vs_faithfulness"):
        assert key in blob, key
    media = run / "wandb"
    samples = list(media.glob("offline-run-*/files/media/table/eval/samples_*.table.json"))
    assert len(samples) == 2 and all(len(json.loads(t.read_text())["data"]) == 4 for t in samples)
    for plot in ("curves", "pareto"):  # the run's plots, as images
        assert len(list(media.glob(f"offline-run-*/files/media/images/plots/{plot}_*.png"))) == 1, plot
    for name, n in (("hallucination", 3), ("karvonen_confusion", 4)):
        tables = list(media.glob(f"offline-run-*/files/media/table/eval/{name}/records_*.table.json"))
        assert len(tables) == 2 and all(len(json.loads(t.read_text())["data"]) == n for t in tables), name
