"""`nla-grpo data tiny` / `data check` as a user runs them, including every bad input."""
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from nla_grpo.shared.data import read_rows
from nla_grpo.dataprep.tiny import write_rl_parquet

from conftest import ROOT, run_cli


def _copy_dataset(tiny_dir, dst):
    """A writable copy of the tiny dataset whose sidecar points at the shared tiny model."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_dir / "rl.parquet", dst / "rl.parquet")
    meta = yaml.safe_load((tiny_dir / "rl.parquet.nla_meta.yaml").read_text())
    meta["extraction"]["base_model"] = str(tiny_dir / "model")
    (dst / "rl.parquet.nla_meta.yaml").write_text(yaml.safe_dump(meta, allow_unicode=True))
    return dst / "rl.parquet", meta


def _expect_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_tiny_then_check(tmp_path):
    res = run_cli("data", "tiny", tmp_path / "t")
    assert res.returncode == 0, res.stderr
    res = run_cli("data", "check", tmp_path / "t" / "rl.parquet")
    assert res.returncode == 0, res.stderr
    assert "rows: 512" in res.stdout and "d_model: 64" in res.stdout and "documents: 256" in res.stdout
    assert "marker_id:" in res.stdout and "neighbour_ids:" in res.stdout
    # a second build into the same place is refused and leaves the first intact
    before = (tmp_path / "t" / "rl.parquet").read_bytes()
    _expect_error(run_cli("data", "tiny", tmp_path / "t"), "exists and is not an empty directory")
    assert (tmp_path / "t" / "rl.parquet").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_missing_file_and_not_parquet(tmp_path):
    _expect_error(run_cli("data", "check", tmp_path / "none.parquet"), "none.parquet", "not found")
    junk = tmp_path / "junk.parquet"
    junk.write_text("hello")
    _expect_error(run_cli("data", "check", junk), "junk.parquet", "not a parquet")


@pytest.mark.parametrize("column", ["prompt", "activation_vector", "doc_id"])
def test_missing_column(tmp_path, tiny_dir, column):
    path, _ = _copy_dataset(tiny_dir, tmp_path)
    table = pq.read_table(path).drop_columns([column])
    pq.write_table(table, path)
    _expect_error(run_cli("data", "check", path), str(path), f"column {column!r} missing")


def _rewrite(path, mutate):
    rows = read_rows(path, 64)
    prompts, acts, docs = mutate(rows.prompts, rows.activations.copy(), rows.doc_ids)
    fixed = isinstance(acts, np.ndarray)
    if fixed:
        write_rl_parquet(path, prompts, acts, docs)
    else:  # ragged: write a variable-size list column directly
        msg = pa.struct([("role", pa.string()), ("content", pa.string())])
        pq.write_table(pa.table({
            "prompt": pa.array(prompts, type=pa.list_(msg)),
            "activation_vector": pa.array([list(map(float, a)) for a in acts], type=pa.list_(pa.float32())),
            "doc_id": pa.array(docs),
        }), path)


def test_wrong_length_fixed(tmp_path, tiny_dir):
    path, _ = _copy_dataset(tiny_dir, tmp_path)
    _rewrite(path, lambda p, a, d: (p, a[:, :32].copy(), d))
    _expect_error(run_cli("data", "check", path), "row 0", "activation_vector", "expected length 64", "found 32")


def test_wrong_length_variable(tmp_path, tiny_dir):
    path, _ = _copy_dataset(tiny_dir, tmp_path)
    _rewrite(path, lambda p, a, d: (p, [x if i != 7 else x[:63] for i, x in enumerate(a)], d))
    _expect_error(run_cli("data", "check", path), "row 7", "expected length 64", "found 63")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite(tmp_path, tiny_dir, bad):
    path, _ = _copy_dataset(tiny_dir, tmp_path)

    def mutate(p, a, d):
        a[300, 5] = bad
        return p, a, d

    _rewrite(path, mutate)
    _expect_error(run_cli("data", "check", path), "row 300", "non-finite")


@pytest.mark.parametrize("content,found", [("no placeholder here", "found 0"), ("<INJECT> and <INJECT>", "found 2")])
def test_prompt_placeholder_count(tmp_path, tiny_dir, content, found):
    path, _ = _copy_dataset(tiny_dir, tmp_path)

    def mutate(p, a, d):
        p = list(p)
        p[11] = [{"role": "user", "content": content}]
        return p, a, d

    _rewrite(path, mutate)
    _expect_error(run_cli("data", "check", path), "row 11", "exactly one <INJECT>", found)


@pytest.mark.parametrize("message,found", [({"content": "<INJECT>"}, "found role None"),
                                           ({"role": "narrator", "content": "<INJECT>"}, "found role 'narrator'")])
def test_prompt_message_needs_a_role(tmp_path, tiny_dir, message, found):
    path, _ = _copy_dataset(tiny_dir, tmp_path)

    def mutate(p, a, d):
        p = list(p)
        p[7] = [message]
        return p, a, d

    _rewrite(path, mutate)
    _expect_error(run_cli("data", "check", path), "row 7", "message 0: expected 'role' one of system, user, assistant", found)


def _edit_sidecar(path, **tokens):
    side = path.with_name(path.name + ".nla_meta.yaml")
    meta = yaml.safe_load(side.read_text())
    for k, v in tokens.items():
        section, key = k.split("__")
        meta[section][key] = v
    side.write_text(yaml.safe_dump(meta, allow_unicode=True))


def test_marker_not_single_token(tmp_path, tiny_dir):
    path, _ = _copy_dataset(tiny_dir, tmp_path)
    _edit_sidecar(path, tokens__injection_char="zq")
    _expect_error(run_cli("data", "check", path), "nla_meta.yaml", "injection_char 'zq'", "single id")


def test_neighbour_mismatch(tmp_path, tiny_dir):
    path, meta = _copy_dataset(tiny_dir, tmp_path)
    _edit_sidecar(path, tokens__injection_left_neighbor_id=meta["tokens"]["injection_left_neighbor_id"] + 7)
    _expect_error(run_cli("data", "check", path), "nla_meta.yaml", "neighbor", "expected")


def test_sidecar_missing(tmp_path, tiny_dir):
    path, _ = _copy_dataset(tiny_dir, tmp_path)
    path.with_name(path.name + ".nla_meta.yaml").unlink()
    _expect_error(run_cli("data", "check", path), "nla_meta.yaml", "sidecar not found")


def test_sidecar_d_inconsistent(tmp_path, tiny_dir):
    path, _ = _copy_dataset(tiny_dir, tmp_path)
    _edit_sidecar(path, extraction__d_model=32)
    res = run_cli("data", "check", path, "--model", tiny_dir / "model")
    _expect_error(res, "extraction.d_model", "expected 64", "found 32")


def test_sidecar_field_missing(tmp_path, tiny_dir):
    path, _ = _copy_dataset(tiny_dir, tmp_path)
    side = path.with_name(path.name + ".nla_meta.yaml")
    meta = yaml.safe_load(side.read_text())
    del meta["tokens"]["injection_token_id"]
    side.write_text(yaml.safe_dump(meta, allow_unicode=True))
    _expect_error(run_cli("data", "check", path), "tokens.injection_token_id: missing")


@pytest.mark.parametrize("text,needle", [
    ("rollout:\n  temprature: 1.0\n", "rollout.temprature: unknown key"),
    ("rollout:\n  group_size: many\n", "rollout.group_size"),
    ("rollout:\n  temperature: 0.7\n", "rollout.temperature: expected 1.0"),
    ("rollout:\n  group_size: 1\n", "rollout.group_size"),
])
def test_bad_config_one_line(tmp_path, text, needle):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    _expect_error(run_cli("train", cfg, "--run-dir", tmp_path / "run"), str(cfg), needle)
    assert not (tmp_path / "run").exists()


def test_help_is_fast_and_lists_commands():
    res = run_cli("--help")
    assert res.returncode == 0 and "train" in res.stdout and "data" in res.stdout and "plot" in res.stdout


@pytest.mark.parametrize("column", ["activation_vector", "prompt"])
def test_a_damaged_row_group_is_one_line_naming_it(tmp_path, tiny_dir, column):
    """The footer intact, one page's bytes flipped: its CRC catches it (garbage values otherwise)."""
    path, _ = _copy_dataset(tiny_dir, tmp_path)
    rows = read_rows(path, 64)
    write_rl_parquet(path, rows.prompts, rows.activations, rows.doc_ids, row_group_size=128)
    meta = pq.ParquetFile(path).metadata
    names = [meta.schema.column(j).path for j in range(meta.num_columns)]
    chunk = meta.row_group(2).column(next(j for j, n in enumerate(names) if n.startswith(column)))
    data = bytearray(path.read_bytes())
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    middle = start + chunk.total_compressed_size // 2
    data[middle] ^= 0xFF
    path.write_bytes(bytes(data))
    _expect_error(run_cli("data", "check", path), str(path), f"row group 2 of {meta.num_row_groups} (rows 256-383) is damaged")


def test_the_tiny_sidecar_is_the_official_format_and_official_sidecars_read(tmp_path, tiny_dir):
    from official_format import official_dataset_problems
    from nla_grpo.shared.spec import load_spec

    meta = yaml.safe_load((tiny_dir / "rl.parquet.nla_meta.yaml").read_text())
    assert official_dataset_problems(meta) == []
    assert meta["row_count"] == pq.ParquetFile(tiny_dir / "rl.parquet").metadata.num_rows
    # an official sidecar as its pipeline writes it: no scales, base_model under extraction
    path, _ = _copy_dataset(tiny_dir, tmp_path)
    side = path.with_name(path.name + ".nla_meta.yaml")
    official = yaml.safe_load(side.read_text())
    scale = official.pop("injection_scale")
    official.pop("mse_scale")
    assert official_dataset_problems(official) == []
    side.write_text(yaml.safe_dump(official, allow_unicode=True))
    spec = load_spec(side)
    assert spec.base_model == str(tiny_dir / "model") and spec.mse_scale_raw == "sqrt_d_model" and spec.injection_scale_raw is None
    # a missing scale never silently means raw: a run says so before anything starts, unless the config sets it
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", "--set", f"data.parquet={path}", "--set", f"model.path={tiny_dir / 'model'}")
    _expect_error(res, "nla_meta.yaml: injection_scale: missing", "set injection.scale in the config")
    res = run_cli("config", "check", ROOT / "deploy/tiny.yaml", "--set", f"data.parquet={path}", "--set", f"model.path={tiny_dir / 'model'}",
                  "--set", f"injection.scale={scale}")
    assert res.returncode == 0, res.stderr
    # a model sidecar, or another schema, is not a dataset sidecar
    for key, value, needle in (("kind", "nla_model", "kind: expected nla_dataset"), ("schema_version", 7, "schema_version: expected one of")):
        side.write_text(yaml.safe_dump({**official, key: value}, allow_unicode=True))
        _expect_error(run_cli("data", "check", path), "nla_meta.yaml", needle)
