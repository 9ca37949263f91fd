"""``nla-grpo data extract`` on the tiny model and a small generated corpus: the vectors are the model's
own hidden states at the positions recorded, splits are document-disjoint, a killed run restarted is
the uninterrupted one, the output passes ``data check`` and the official reader, bad inputs are one line."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_cli
from nla_grpo.shared.errors import NlaInputError
from nla_grpo.dataprep.extract import extract, parse_splits, split_of

WORDS = "sea wave salt ship tide fish coral harbor sailor storm tree leaf moss wolf pine".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    docs = [{"text": " ".join(rng.choice(WORDS, int(rng.integers(3, 70)))), "doc_id": f"d{i}"} for i in range(60)]
    path.write_text("".join(json.dumps(d) + "\n" + ("\n" if i == 7 else "") for i, d in enumerate(docs)))  # a blank line is skipped
    return path, {d["doc_id"]: d["text"] for d in docs}


def _extract(corpus_path, tiny_dir, out, **kw):
    return extract(corpus_path, tiny_dir / "model", 0, out, positions_per_doc=3, min_position=8, chunk_docs=16,
                   batch_size=5, log=lambda m: None, **kw)


def test_vectors_are_the_models_hidden_states_and_splits_are_disjoint(tiny_dir, corpus, tmp_path, monkeypatch):
    """Each batch the extraction runs equals the whole model's own ``output_hidden_states[K + 1]`` on that
    batch (fp32, <= 1e-5; the same computation). Each written vector is the residual of its document run
    alone at its recorded position, to fp32 precision: a padded batch has other matrix shapes than one
    document, and fp32 kernels sum in shape-dependent order (measured: up to 1.0e-5 on residuals of
    magnitude ~12 on a 2-core AMD EPYC, 0 on others); a wrong position or padding is off by O(1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from official_format import official_dataset_problems
    from nla_grpo.dataprep.extract import Extractor
    from nla_grpo.shared.torch_utils import right_pad

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32).eval()
    residuals, batch_worst = Extractor.residuals, []

    def checked(self, ids):
        got = residuals(self, ids)
        x, mask = right_pad(ids, 0, "cpu")
        with torch.no_grad():
            want = model(x, attention_mask=mask, output_hidden_states=True).hidden_states[1]
        batch_worst.append(max(float((got[i, :len(r)] - want[i, :len(r)]).abs().max()) for i, r in enumerate(ids)))
        return got

    monkeypatch.setattr(Extractor, "residuals", checked)
    path, texts = corpus
    written = _extract(path, tiny_dir, tmp_path / "out")
    assert set(written) == {"av_sft", "ar_sft", "rl"}
    assert len(batch_worst) >= 8 and max(batch_worst) <= 1e-5, batch_worst
    tok = AutoTokenizer.from_pretrained(tiny_dir / "model")
    docs_by_split, worst, rows = {}, 0.0, 0
    for name, parquet in written.items():
        t = pq.read_table(parquet)
        assert t.schema.field("activation_vector").type == pa.list_(pa.float32(), 64)
        vecs = np.asarray(t.column("activation_vector").combine_chunks().flatten()).reshape(-1, 64)
        for doc, n, text, layer, vec in zip(t.column("doc_id").to_pylist(), t.column("n_raw_tokens").to_pylist(),
                                            t.column("detokenized_text_truncated").to_pylist(),
                                            t.column("activation_layer").to_pylist(), vecs):
            ids = tok(texts[doc])["input_ids"]
            with torch.no_grad():
                hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]
            worst = max(worst, float((hs[n - 1] - torch.tensor(vec)).abs().max()))
            assert layer == 0 and n - 1 >= 8 and texts[doc].startswith(text)
            assert tok(text)["input_ids"] == ids[:n]  # the text up to and including the position
            rows += 1
        docs_by_split[name] = set(t.column("doc_id").to_pylist())
        assert all(split_of(d, parse_splits("av_sft=0.25,ar_sft=0.25,rl=0.5"), 0) == name for d in docs_by_split[name])
        meta = __import__("yaml").safe_load(parquet.with_name(parquet.name + ".nla_meta.yaml").read_text())
        assert official_dataset_problems(meta) == [] and meta["row_count"] == t.num_rows and meta["stage"] == name
        if name == "rl":
            res = run_cli("data", "check", parquet, timeout=120)
            assert res.returncode == 0, res.stderr
    assert worst <= 1e-4 and rows > 60, (worst, rows)
    a, b, c = docs_by_split.values()
    assert not (a & b or a & c or b & c)
    short = {d for d, text in texts.items() if len(tok(text)["input_ids"]) <= 8}
    assert short and not short & (a | b | c)  # too short for --min-position: no rows


def test_a_killed_extraction_restarted_equals_an_uninterrupted_one(tiny_dir, corpus, tmp_path):
    path, _ = corpus
    whole = _extract(path, tiny_dir, tmp_path / "whole")
    out = tmp_path / "killed"
    assert _extract(path, tiny_dir, out, stop_after_chunks=2) == {}
    parts = sorted((out / ".extract" / "rl").glob("part-*.parquet"))
    assert [p.name for p in parts] == ["part-000000.parquet", "part-000001.parquet"]
    (out / ".extract" / "rl" / "part-000002.parquet").write_bytes(b"half a part")  # the kill hit mid-write
    with pytest.raises(NlaInputError, match="other arguments is here .seed differ."):
        _extract(path, tiny_dir, out, seed=1)
    again = _extract(path, tiny_dir, out)
    for name in whole:
        assert pq.read_table(again[name]).equals(pq.read_table(whole[name])), name
        assert again[name].with_name(name + ".parquet.nla_meta.yaml").read_text() == \
            whole[name].with_name(name + ".parquet.nla_meta.yaml").read_text()
    assert not (out / ".extract").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ray_workers_give_the_same_dataset(tiny_dir, corpus, tmp_path):
    """One Ray task per worker over every other chunk (a GPU each on a GPU node), merged in chunk order."""
    path, _ = corpus
    whole = _extract(path, tiny_dir, tmp_path / "one")
    out = tmp_path / "two"
    res = run_cli("data", "extract", path, "--model", tiny_dir / "model", "--layer", "0", "--out", out, "--workers", "2",
                  "--positions-per-doc", "3", "--min-position", "8", "--batch-size", "5", "--chunk-docs", "16", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "documents |" in res.stdout and "docs/s" in res.stdout
    for name in whole:
        assert pq.read_table(out / f"{name}.parquet").equals(pq.read_table(whole[name])), name


def test_bad_inputs_are_one_line(tiny_dir, corpus, tmp_path):
    path, _ = corpus
    pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "notext.parquet")
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": "fine text"}) + "\n" + json.dumps({"text": "  "}) + "\n")
    for args, needle in (
        ((tmp_path / "notext.parquet", "--layer", "0"), "no 'text' column (found ['body'])"),
        ((tmp_path / "empty.jsonl", "--layer", "0"), "row 1, 'text': empty document"),
        ((path, "--layer", "2"), "--layer: expected 0..1"),
        ((path, "--layer", "0", "--splits", "rl=0.7,av_sft=0.2"), "expected shares summing to 1"),
        ((path, "--layer", "0", "--injection-char", "moss"), "--injection-char: expected one token"),
        ((path, "--layer", "0", "--min-position", "64", "--max-tokens", "64"), "--min-position: expected below --max-tokens (64)"),
    ):
        out = tmp_path / "out"
        res = run_cli("data", "extract", *args, "--model", tiny_dir / "model", "--out", out, timeout=120)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and needle in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and not any((out / n).exists() for n in ("rl.parquet", "av_sft.parquet"))
