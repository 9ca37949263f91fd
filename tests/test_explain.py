"""``data explain`` against a scripted teacher on loopback (``teacher_server.TeacherServer``, answers a
function of the prompt): the prompt marks the token, replies are kept only when they are explanations,
a straight run writes the explained splits and a sidecar the official reader takes, a run killed with
SIGKILL and resumed gives the same files without asking any row twice, empty answers are asked again,
refusals are dropped and counted, and every teacher or input problem is one line with nothing written."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT, run_cli
from nla_grpo.dataprep import explain
from nla_grpo.dataprep.explain import explain_splits, parse_teacher_reply, teacher_prompt
from nla_grpo.shared.errors import NlaInputError
from teacher_server import TeacherServer

WORDS = "sea salt ship tide fish coral harbor storm".split()
ROWS = {"av_sft": 40, "ar_sft": 24}


def make_splits(d: Path, rows=ROWS) -> dict:
    """Splits in ``data extract``'s schema (its own table writer) and sidecars; returns the answers the
    scripted teacher must give, per split in row order. Every fifth row's ``activation_token`` does not
    end its text, so the marker goes after the text."""
    from nla_grpo.dataprep.extract import AR_TEMPLATE, AV_TEMPLATE, _table

    d.mkdir(parents=True, exist_ok=True)
    prompt = [{"role": "user", "content": AV_TEMPLATE.format(injection_char="<INJECT>")}]
    expected = {}
    for split, n in rows.items():
        recs, expected[split] = [], []
        for i in range(n):
            words = [WORDS[(i + k) % len(WORDS)] for k in range(2 + i % 4)] + [f"{split}{i}"]
            token = words[-1] if i % 5 else "elsewhere"
            recs.append({"doc_id": f"{split}-{i // 3}", "vector": np.full(8, i, np.float32), "layer": 0,
                         "n_raw_tokens": len(words), "text": " ".join(words), "token": token})
            expected[split].append(f"{words[-1]} after {words[-2]}" if i % 5 else f"END after {words[-1]}")
        pq.write_table(_table(recs, 8, prompt), d / f"{split}.parquet")
        meta = {"kind": "nla_dataset", "schema_version": 1, "dataset_id": f"{split}_test", "stage": split, "row_count": n,
                "extraction": {"base_model": "model", "d_model": 8, "layer_index": 0, "norm": "none", "corpus": "test",
                               "corpus_slice": {"start": 0, "length": n}, "positions_per_doc": 3},
                "tokens": {"injection_char": "※", "injection_token_id": 400, "injection_left_neighbor_id": 401,
                           "injection_right_neighbor_id": 402, "critic_suffix_ids": None},
                "prompt_templates": {"actor": AV_TEMPLATE, "critic": AR_TEMPLATE}, "injection_scale": 1.5}
        (d / f"{split}.parquet.nla_meta.yaml").write_text(yaml.safe_dump(meta, sort_keys=False, allow_unicode=True))
    return expected


def cli(d, url, *extra, wait=True):
    """``python -m nla_grpo.dataprep.explain`` as a user would run it (a fresh process)."""
    cmd = [sys.executable, "-m", "nla_grpo.dataprep.explain", str(d), "--base-url", url, "--model", "teacher", "--retries", "0",
           "--concurrency", "4", *map(str, extra)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def run(d, url, **kw):
    kw = {"concurrency": 4, "retries": 0, "log": lambda m: None, "progress": False, **kw}
    return explain_splits(d, base_url=url, model="teacher", **kw)


def nothing_written(d: Path) -> bool:
    return not list(d.glob("*.explained.parquet*")) and not (d / ".explain").exists()


def journal_lines(d: Path) -> int:
    return sum(len([l for l in p.read_text().splitlines() if l.endswith("}")]) for p in (d / ".explain").rglob("shard-*.jsonl"))


def test_the_prompt_marks_the_token_and_only_explanations_are_kept():
    system, user = teacher_prompt("the sea and the salt", " salt")
    assert "<document>\nthe sea and the ⟦salt⟧\n</document>" in user and "<explanation>" in user
    assert "few words" in user and "comes next" in user and system
    assert "<document>\nthe sea and the salt⟦⟧\n</document>" in teacher_prompt("the sea and the salt", "ship")[1]
    assert "<document>\nno token⟦⟧\n</document>" in teacher_prompt("no token", None)[1]
    assert parse_teacher_reply("<explanation> sea\nsalt  water </explanation>") == "sea salt water"
    assert parse_teacher_reply("Sure: <explanation>a ship</explanation> hope it helps") == "a ship"
    for bad in (None, "", "   ", "a ship, no tags", "<explanation>  </explanation>", "I'm sorry, I can't do that.",
                "<explanation>I cannot tell what this is.</explanation>", "<explanation>As an AI, I ...</explanation>",
                "<explanation>Sorry, no.</explanation>", "I won't.", "<explanation>" + "a long essay line\n" * 40 + "</explanation>"):
        assert parse_teacher_reply(bad) is None, bad


def test_a_straight_run_writes_the_explained_splits_and_a_sidecar_the_official_reader_takes(tmp_path):
    from official_format import official_dataset_problems
    from nla_grpo.shared.spec import load_spec

    expected = make_splits(tmp_path)
    lines = []
    with TeacherServer() as server:
        usage = run(tmp_path, server.url, log=lines.append)
        assert set(server.temperatures) == {0.0} and max(server.seen.values()) == 1
        assert len(server.seen) == sum(ROWS.values())
        again = []
        run(tmp_path, server.url, log=again.append)  # complete: skipped, nothing asked
        assert len(server.seen) == sum(ROWS.values()) and sum(server.seen.values()) == sum(ROWS.values())
    assert sum("already complete" in l for l in again) == 2
    assert not (tmp_path / ".explain").exists()
    for split, n in ROWS.items():
        out = pq.read_table(tmp_path / f"{split}.explained.parquet")
        src = pq.read_table(tmp_path / f"{split}.parquet")
        assert out.column("explanation").to_pylist() == expected[split]
        assert out.drop(["explanation"]).equals(src)  # every column kept, rows in source order
        side = tmp_path / f"{split}.explained.parquet.nla_meta.yaml"
        meta = yaml.safe_load(side.read_text())
        rec = meta.pop("explanations")
        assert rec["teacher_model"] == "teacher" and rec["teacher_api"] == "openai" and rec["teacher_base_url"] == server.url
        assert rec["prompt_version"] == explain.PROMPT_VERSION and rec["source"] == f"{split}.parquet"
        assert (rec["rows_in"], rec["rows_kept"], rec["dropped"], rec["refusals"]) == (n, n, 0, 0)
        assert rec["tokens_in"] > 0 and rec["tokens_out"] == 3 * n and usage[split]["tokens_in"] == rec["tokens_in"]
        assert meta == {**yaml.safe_load((tmp_path / f"{split}.parquet.nla_meta.yaml").read_text()), "row_count": n}
        assert load_spec(side).d_model == 8 and official_dataset_problems(meta) == []
    assert usage["total"]["rows_kept"] == sum(ROWS.values())
    assert lines[-1].startswith("[explain] total: 64 rows, 64 kept, 0 dropped, tokens in ")


def test_empty_answers_are_asked_again_and_refusals_dropped_and_counted(tmp_path):
    expected = make_splits(tmp_path, {"av_sft": 20})
    refused = lambda user: "I'm sorry, I can't help." if "av_sft7⟧" in user or "av_sft13⟧" in user else None
    with TeacherServer(empty_first=True, reply_fn=refused) as server:
        usage = run(tmp_path, server.url, splits=("av_sft",))
    assert sorted(set(server.seen.values())) == [2, 3]  # every row once more; the refusals twice more, then dropped
    assert server.temperatures.count(0.0) == 20 and server.temperatures.count(1.0) == 18 + 2 * 2
    out = pq.read_table(tmp_path / "av_sft.explained.parquet")
    assert out.column("explanation").to_pylist() == [e for i, e in enumerate(expected["av_sft"]) if i not in (7, 13)]
    assert out.column("doc_id").to_pylist() == [f"av_sft-{i // 3}" for i in range(20) if i not in (7, 13)]
    assert (usage["av_sft"]["rows_kept"], usage["av_sft"]["dropped"], usage["av_sft"]["refusals"]) == (18, 2, 2)
    assert usage["av_sft"]["dropped_refusal"] == 2 and usage["av_sft"]["dropped_empty"] == 0
    assert yaml.safe_load((tmp_path / "av_sft.explained.parquet.nla_meta.yaml").read_text())["row_count"] == 18


def test_a_killed_run_resumed_equals_a_straight_run_and_asks_no_row_twice(tmp_path):
    make_splits(tmp_path / "straight")
    make_splits(tmp_path / "killed")
    with TeacherServer() as server:
        run(tmp_path / "straight", server.url)
        server.answered.clear()
        server.seen.clear()
        server.block_after = 30
        proc = cli(tmp_path / "killed", server.url, wait=False)
        deadline = time.time() + 60
        while server.blocked < 4 and time.time() < deadline:  # all four requests in flight hang: nothing more is answered
            time.sleep(0.05)
        while journal_lines(tmp_path / "killed") < sum(server.answered.values()) and time.time() < deadline:
            time.sleep(0.05)
        assert server.blocked == 4 and journal_lines(tmp_path / "killed") == sum(server.answered.values()) >= 30
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        assert not list((tmp_path / "killed").glob("*.explained.parquet*"))
        shard = sorted((tmp_path / "killed" / ".explain" / "av_sft").glob("shard-*.jsonl"))[-1]
        with open(shard, "a") as f:
            f.write('{"split": "av_sft", "row": 39, "explan')  # as a kill mid-write leaves it
        with pytest.raises(NlaInputError, match=r"other arguments is here \(model differ\)"):
            explain_splits(tmp_path / "killed", base_url=server.url, model="another", log=lambda m: None, progress=False)
        server.block_after = None
        res = cli(tmp_path / "killed", server.url)
        assert res.returncode == 0, res.stderr
        assert "resuming" in res.stdout and "next:" in res.stdout
    assert max(server.answered.values()) == 1 and len(server.answered) == sum(ROWS.values())
    assert not (tmp_path / "killed" / ".explain").exists()
    for split in ROWS:
        for name in (f"{split}.explained.parquet", f"{split}.explained.parquet.nla_meta.yaml"):
            assert (tmp_path / "killed" / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name


def test_a_second_run_on_the_same_directory_is_one_line(tmp_path):
    make_splits(tmp_path)
    with TeacherServer(block_after=0) as server:
        first = cli(tmp_path, server.url, wait=False)
        deadline = time.time() + 60
        while server.blocked < 1 and time.time() < deadline:
            time.sleep(0.05)
        second = cli(tmp_path, server.url)
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1, second.stderr
    assert "another `data explain` is running on this directory" in second.stderr
    assert not list(tmp_path.glob("*.explained.parquet"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["refuses", "401", "chat 401", "unreachable"])
def test_a_teacher_that_refuses_or_cannot_be_reached_is_one_line_and_writes_nothing(tmp_path, case):
    make_splits(tmp_path)
    needle = {"refuses": "refused or gave no usable explanation for the first 16 rows of av_sft (last reply: \"I'm sorry",
              "401": "refuses the key (HTTP 401", "chat 401": "refuses the request: HTTP 401",
              "unreachable": "does not answer (ConnectError"}[case]
    if case == "unreachable":
        res = cli(tmp_path, f"http://127.0.0.1:{_closed_port()}/v1")
    else:
        with TeacherServer(refuse=case == "refuses", status=401 if case == "401" else None,
                           chat_status=401 if case == "chat 401" else None) as server:
            res = cli(tmp_path, server.url)
        if case == "refuses":
            asked = sorted(server.seen.values())  # each asked three times, stopped at the guard (4 in flight)
            assert 16 <= len(asked) < 16 + 4 and asked.count(3) >= 16 and max(asked) == 3
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("nla-grpo: error: --base-url: ") and needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and nothing_written(tmp_path)


def test_bad_splits_are_one_line(tmp_path):
    make_splits(tmp_path)
    table = pq.read_table(tmp_path / "ar_sft.parquet").drop(["detokenized_text_truncated"])
    pq.write_table(table, tmp_path / "ar_sft.parquet")
    with TeacherServer() as server:
        res = cli(tmp_path, server.url)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "ar_sft.parquet: column 'detokenized_text_truncated' missing" in res.stderr
        (tmp_path / "ar_sft.parquet").unlink()
        with pytest.raises(NlaInputError, match="ar_sft.parquet: split ar_sft not found"):
            run(tmp_path, server.url)
        (tmp_path / "av_sft.parquet.nla_meta.yaml").unlink()
        with pytest.raises(NlaInputError, match="av_sft.parquet.nla_meta.yaml: sidecar not found"):
            run(tmp_path, server.url, splits=("av_sft",))
        with pytest.raises(NlaInputError, match="--max-rows: expected at least 1, found 0"):
            run(tmp_path, server.url, max_rows=0)
        assert not server.seen
    assert nothing_written(tmp_path)


def test_max_rows_takes_the_first_rows_and_anthropic_usage_is_counted(tmp_path):
    """``max_rows`` explains a prefix; the client reads each API's usage (0 where none is reported)."""
    from nla_grpo.evals.chat_client import ChatClient

    expected = make_splits(tmp_path)
    with TeacherServer() as server:
        usage = run(tmp_path, server.url, max_rows=5)
    assert pq.read_table(tmp_path / "av_sft.explained.parquet").column("explanation").to_pylist() == expected["av_sft"][:5]
    assert usage["total"]["rows_in"] == 10
    client = ChatClient("anthropic", "http://127.0.0.1:9", "m")
    assert client._parse({"content": [{"type": "text", "text": "hi"}], "usage": {"input_tokens": 7, "output_tokens": 2}}) == ("hi", 7, 2)
    assert client._parse({"content": [{"type": "text", "text": "hi"}]}) == ("hi", 0, 0)
    client.close()


def test_why_rows_were_dropped_is_counted_and_printed(tmp_path):
    make_splits(tmp_path, {"av_sft": 20})
    scripted = {"av_sft3⟧": "", "av_sft6⟧": "   ", "av_sft7⟧": "a ship, no tags", "av_sft8⟧": "I'm sorry, I can't.",
                "av_sft9⟧": "<explanation>" + "a long essay line\n" * 40 + "</explanation>"}
    reply = lambda user: next((text for mark, text in scripted.items() if mark in user), None)
    lines = []
    with TeacherServer(reply_fn=reply) as server:
        usage = run(tmp_path, server.url, splits=("av_sft",), log=lines.append)
    u = usage["av_sft"]
    assert (u["rows_kept"], u["dropped"]) == (15, 5)
    assert (u["dropped_empty"], u["dropped_no_tags"], u["dropped_refusal"], u["dropped_too_long"]) == (2, 1, 1, 1)
    assert lines[0].startswith("[explain] av_sft: 20 rows, 15 kept, 5 dropped (2 empty, 1 refusal, 1 no tags, 1 too long), ")
    rec = yaml.safe_load((tmp_path / "av_sft.explained.parquet.nla_meta.yaml").read_text())["explanations"]
    assert rec["dropped_empty"] == 2 and rec["dropped_too_long"] == 1


def _cli(*args, **kw):
    """``nla-grpo`` itself, as a user runs it (a fresh process)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "nla_grpo.orchestrator.cli", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_the_fixture_teacher_names_the_marked_token_and_is_labelled(tmp_path):
    expected = make_splits(tmp_path, {"av_sft": 20, "ar_sft": 10})
    out, err = _cli("data", "explain", tmp_path, "--teacher", "fixture").communicate(timeout=120)
    assert "the tiny fixture's rule" in out and "[explain] total: 30 rows, 24 kept, 6 dropped (6 empty)" in out, out + err
    # the rule names the marked token; where the token does not end the text the mark is empty: dropped
    got = pq.read_table(tmp_path / "av_sft.explained.parquet").column("explanation").to_pylist()
    assert got == [e.split(" after ")[0] for e in expected["av_sft"] if not e.startswith("END")]
    rec = yaml.safe_load((tmp_path / "av_sft.explained.parquet.nla_meta.yaml").read_text())["explanations"]
    assert rec["teacher_model"] == "tiny-fixture-rule" and rec["teacher_base_url"].startswith("http://127.0.0.1:")
    for args, needle in ((["--teacher", "fixture", "--model", "gpt"], "--model: --teacher fixture is its own teacher"),
                         (["--model", "gpt"], "--base-url: the teacher's base url is needed (or --teacher fixture")):
        res = run_cli("data", "explain", tmp_path / "elsewhere", *args)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and needle in res.stderr, res.stderr
        assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_explain_is_one_true_line_and_the_rerun_resumes(tmp_path, sig, code):
    make_splits(tmp_path)
    with TeacherServer(block_after=30) as server:
        proc = _cli("data", "explain", tmp_path, "--base-url", server.url, "--model", "teacher", "--concurrency", "4")
        deadline = time.time() + 60
        while server.blocked < 4 and time.time() < deadline:
            time.sleep(0.05)
        while journal_lines(tmp_path) < sum(server.answered.values()) and time.time() < deadline:
            time.sleep(0.05)
        journaled = journal_lines(tmp_path)
        assert journaled >= 30
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == code and len(err.strip().splitlines()) == 1, (proc.returncode, err)
        assert f"interrupted ({sig.name})" in err and f"{journaled} answered rows are journaled" in err, err
        assert "the same command asks only the rest" in err and "Traceback" not in err
        server.block_after = None
        again = run_cli("data", "explain", tmp_path, "--base-url", server.url, "--model", "teacher")
    assert again.returncode == 0 and f"resuming, {journaled} of 40 rows answered" in again.stdout, again.stdout + again.stderr
