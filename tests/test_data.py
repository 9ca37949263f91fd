import filecmp
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nla_grpo.shared.data import ShuffledOrder, is_eval_doc, read_rows, split_eval
from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.prompts import find_marker_site, has_marker_trigram, render_av_ids, render_critic_text
from nla_grpo.shared.spec import load_spec, sidecar_path, validate_against_tokenizer
from nla_grpo.dataprep.tiny import build_tiny, write_rl_parquet


def test_tiny_is_byte_identical_per_seed(tmp_path, tiny_dir):
    again = build_tiny(tmp_path / "again", seed=0)
    cmp = filecmp.dircmp(tiny_dir, again)
    files = ["rl.parquet", "rl.parquet.nla_meta.yaml", "topics.json"]
    assert filecmp.cmpfiles(tiny_dir, again, files, shallow=False)[0] == files
    mfiles = sorted(p.name for p in (tiny_dir / "model").iterdir())
    assert "model.safetensors" in mfiles and "tokenizer.json" in mfiles
    assert filecmp.cmpfiles(tiny_dir / "model", again / "model", mfiles, shallow=False)[0] == mfiles
    assert not cmp.left_only and not cmp.right_only
    other = build_tiny(tmp_path / "other", seed=1)
    assert not filecmp.cmp(tiny_dir / "rl.parquet", other / "rl.parquet", shallow=False)
    assert not list(tmp_path.glob(".tiny-*")), "temporary build directories left behind"


def test_tiny_activations_cluster_by_topic(tiny_dir):
    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    rows = read_rows(tiny_dir / "rl.parquet", spec.d_model)
    topics = np.array(json.loads((tiny_dir / "topics.json").read_text()))
    v = rows.activations / np.linalg.norm(rows.activations, axis=1, keepdims=True)
    sim = v @ v.T
    for t in set(topics):
        m = topics == t
        assert sim[m][:, m].mean() > 0.8 and sim[m][:, ~m].mean() < 0.1


def test_spec_and_prompts_against_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "model")
    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    validate_against_tokenizer(spec, tok)
    rows = read_rows(tiny_dir / "rl.parquet", spec.d_model)
    ids = render_av_ids(tok, rows.prompts[0], spec.marker, prefill="<explanation>", enable_thinking=False)
    p = find_marker_site(ids, spec.marker_id, spec.left_id, spec.right_id)
    assert ids[p] == spec.marker_id and ids[p - 1] == spec.left_id and ids[p + 1] == spec.right_id
    assert tok.decode(ids).endswith("</think>\n\n<explanation>")  # enable_thinking=False + prefill
    # unset (the default, the reference trainer's rendering): the template is not told, no empty think block
    unset = render_av_ids(tok, rows.prompts[0], spec.marker, prefill="<explanation>")
    assert tok.decode(unset).endswith("assistant\n<explanation>") and "<think>" not in tok.decode(unset)
    assert render_av_ids(tok, rows.prompts[0], spec.marker, enable_thinking=True) == render_av_ids(tok, rows.prompts[0], spec.marker)
    assert has_marker_trigram([5, spec.left_id, spec.marker_id, spec.right_id], spec.marker_id, spec.left_id, spec.right_id)
    assert not has_marker_trigram([spec.marker_id, spec.right_id], spec.marker_id, spec.left_id, spec.right_id)
    with pytest.raises(ValueError, match="found 2 occurrence"):
        find_marker_site(ids + ids, spec.marker_id, spec.left_id, spec.right_id)
    assert render_critic_text(spec.ar_template, "sea ship") == "Explanation: sea ship\nReconstruct the concept."


def test_fixed_and_variable_lists_read_the_same(tmp_path, tiny_dir):
    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    rows = read_rows(tiny_dir / "rl.parquet", spec.d_model)
    path = tmp_path / "var.parquet"
    write_rl_parquet(path, rows.prompts, rows.activations, rows.doc_ids, row_group_size=50, fixed_size=False)
    assert pa.types.is_list(pq.read_schema(path).field("activation_vector").type)
    again = read_rows(path, spec.d_model)
    assert np.array_equal(again.activations, rows.activations) and again.doc_ids == rows.doc_ids
    head = read_rows(path, spec.d_model, max_rows=120)
    assert len(head) == 120 and np.array_equal(head.activations, rows.activations[:120])


def test_eval_split_is_document_disjoint_and_stable(tiny_dir):
    rows = read_rows(tiny_dir / "rl.parquet", 64)
    train, ev = split_eval(rows, 0.2)
    assert len(train) + len(ev) == len(rows) and 0 < len(ev) < len(rows)
    assert not set(train.doc_ids) & set(ev.doc_ids)
    assert [is_eval_doc(d, 0.2) for d in ev.doc_ids] == [True] * len(ev)
    assert split_eval(rows, 0.2)[1].doc_ids == ev.doc_ids
    assert len(split_eval(rows, 0.0)[1]) == 0


def test_shuffled_order_deterministic_and_resumable():
    a = ShuffledOrder(10, seed=3)
    straight = [a.next_batch(4) for _ in range(6)]
    b = ShuffledOrder(10, seed=3)
    first = [b.next_batch(4) for _ in range(3)]
    state = json.loads(json.dumps(b.state()))
    c = ShuffledOrder.from_state(state)
    assert first + [c.next_batch(4) for _ in range(3)] == straight
    epoch0 = straight[0] + straight[1]
    assert len(set(epoch0)) == 8  # no repeats inside an epoch
    assert straight[2] != straight[0]  # a new permutation each epoch
    assert ShuffledOrder(10, seed=4).next_batch(4) != ShuffledOrder(10, seed=3).next_batch(4)
    with pytest.raises(ValueError):
        ShuffledOrder(3, seed=0).next_batch(4)


def test_learning_summary_means_first_and_last_windows_and_collects_evals():
    from nla_grpo.dataprep.tiny import learning_summary

    rows = [{"step": i, "reward_mean": float(i), "fve": -float(i)} for i in range(10)]
    rows[4]["eval/fve"] = 0.5
    got = learning_summary(rows, window=3)
    assert (got["reward_first"], got["reward_last"]) == (1.0, 8.0)
    assert (got["fve_first"], got["fve_last"]) == (-1.0, -8.0)
    assert got["eval_fve"] == {4: 0.5} and got["steps"] == 10


def test_a_text_column_is_read_for_the_rows_asked_and_refused_in_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nla_grpo.shared.data import read_text_column

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["zero", "one", " ", None]}), path)
    assert read_text_column(path, "text", [1, 0], "unused") == ["one", "zero"]
    with pytest.raises(NlaInputError, match=r"t.parquet: needed for the judge, found columns \['text'\]"):
        read_text_column(path, "source", [0], "needed for the judge, found columns {names}")
    for row, found in ((2, "' '"), (3, "None")):
        with pytest.raises(NlaInputError, match=f"row {row}, column 'text': expected the source text, found {found}"):
            read_text_column(path, "text", [0, row], "unused", "the source text")
