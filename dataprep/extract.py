"""``nla-grpo data extract``: an RL dataset (and its SFT splits) from a subject model and a corpus.

For each document: its tokenisation (with the tokenizer's own special tokens), up to
``positions_per_doc`` positions drawn from ``min_position`` on (seeded by the document's id, so a
document always gets the same ones), and at each the residual stream after block ``layer`` (what
``output_hidden_states[layer + 1]`` holds), raw. The model runs cut after that block, on batches of
documents sorted by length. A row per position: ``prompt`` (the AV template with ``<INJECT>``),
``activation_vector`` (FixedSizeList<float32, d>), ``doc_id``, ``activation_layer``, ``n_raw_tokens``
(document tokens up to and including the position: the vector is the residual at token index
``n_raw_tokens - 1``), ``detokenized_text_truncated`` (the text up to the position) and
``activation_token`` (that token decoded, which the explanation stage marks in the text). Documents go
to splits by a hash of ``doc_id``, so the splits are disjoint by construction.

Streaming and resumable: the corpus is read in chunks of ``chunk_docs`` documents; each chunk's rows
become one row group per split, written as a part file and recorded in ``OUT/.extract/state.json``
only when every split's part is complete. A restart with the same arguments continues after the last
recorded chunk, so a killed run ends equal to an uninterrupted one. At the end the parts are merged
into ``OUT/<split>.parquet`` (row group by row group) beside their sidecars, in the official format.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.fileio import lock_directory, write_json

AV_TEMPLATE = "Describe the concept <concept>{injection_char}</concept> in a few words."
AR_TEMPLATE = "Explanation: {explanation}\nReconstruct the concept."
STATE = "state.json"


def parse_splits(text: str) -> dict[str, float]:
    """``av_sft=0.25,ar_sft=0.25,rl=0.5`` -> shares that sum to 1 (one line naming the problem otherwise)."""
    out = {}
    for part in text.split(","):
        name, _, share = part.partition("=")
        try:
            value = float(share)
        except ValueError:
            value = float("nan")
        if not name.strip() or not (0 < value <= 1) or name.strip() in out:
            raise NlaInputError("--splits", f"expected name=share pairs with shares in (0, 1], found {part!r}")
        out[name.strip()] = value
    if abs(sum(out.values()) - 1.0) > 1e-6 or "rl" not in out:
        raise NlaInputError("--splits", f"expected shares summing to 1 with an 'rl' split, found {text!r}")
    return out


def split_of(doc_id: str, splits: dict[str, float], seed: int) -> str:
    """The split a document goes to: a hash of its id (and the seed) against the cumulative shares."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big") / 2**64
    acc = 0.0
    for name, share in splits.items():
        acc += share
        if h < acc:
            return name
    return list(splits)[-1]


def positions_for(doc_id: str, n_tokens: int, k: int, min_position: int, seed: int) -> list[int]:
    """Up to ``k`` sorted token positions in ``[min_position, n_tokens)``, the same for a document every time."""
    if n_tokens <= min_position:
        return []
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(f"{seed}:pos:{doc_id}".encode()).digest()[:8], "big"))
    pool = np.arange(min_position, n_tokens)
    return sorted(int(p) for p in rng.choice(pool, size=min(k, len(pool)), replace=False))


def iter_corpus(path: Path, text_column: str = "text"):
    """``(index, doc_id, text)`` streamed from a parquet or JSONL corpus; bad rows are one line."""
    stem = path.stem
    if not path.is_file():
        raise NlaInputError(path, "corpus not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as exc:
            raise NlaInputError(path, f"not a parquet file ({(str(exc).splitlines() or [''])[0][:80]})") from None
        names = pf.schema_arrow.names
        if text_column not in names:
            raise NlaInputError(path, f"no '{text_column}' column (found {names})")
        cols = [text_column] + (["doc_id"] if "doc_id" in names else [])
        i = 0
        for batch in pf.iter_batches(columns=cols, batch_size=1024):
            texts = batch.column(text_column).to_pylist()
            ids = batch.column("doc_id").to_pylist() if "doc_id" in cols else [None] * len(texts)
            for text, doc in zip(texts, ids):
                yield i, _doc_id(doc, stem, i), _text(text, path, i, text_column)
                i += 1
        return
    from nla_grpo.shared.fileio import iter_jsonl

    for i, (n, rec) in enumerate(iter_jsonl(path)):
        if text_column not in rec:
            raise NlaInputError(path, f"line {n}: no '{text_column}' field")
        yield i, _doc_id(rec.get("doc_id"), stem, i), _text(rec[text_column], path, i, text_column)


def _doc_id(doc, stem: str, i: int) -> str:
    return str(doc) if doc is not None and str(doc) != "" else f"{stem}:{i}"


def _text(text, path: Path, i: int, column: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise NlaInputError(path, f"row {i}, '{column}': empty document ({text!r})")
    return text


def corpus_size(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class Extractor:
    """The model cut after block ``layer`` (final norm dropped), in ``dtype`` on ``device``."""

    def __init__(self, model_dir: Path, layer: int, device: str, dtype):
        import torch
        from transformers import AutoModelForCausalLM

        from nla_grpo.shared.model_facts import hf_config

        config = hf_config(model_dir)
        text = getattr(config, "text_config", None) or config
        text.num_hidden_layers = layer + 1  # nothing after block `layer` is computed
        from transformers.utils import logging as hf_logging

        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # the blocks after `layer` are left out on purpose: no load report
        hf_logging.disable_progress_bar()  # the extraction prints its own progress
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype).to(device).eval()
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        self.body = model.get_decoder()  # the language model's decoder, also inside a multimodal wrapper
        if not isinstance(getattr(self.body, "norm", None), torch.nn.Module):
            raise NlaInputError(model_dir, f"no final norm found on {type(self.body).__name__}: cannot take the raw residual")
        self.body.norm = torch.nn.Identity()  # the residual after block `layer`, not its normalised form
        self.device, self.d_model = device, text.hidden_size

    def residuals(self, ids: list[list[int]]):
        """``[B, T, d]`` residuals of right-padded documents (float32, on the CPU)."""
        import torch

        from nla_grpo.shared.torch_utils import right_pad

        x, mask = right_pad(ids, 0, self.device)
        with torch.no_grad():
            return self.body(input_ids=x, attention_mask=mask).last_hidden_state.float().cpu()


def _schema(d: int):
    import pyarrow as pa

    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([("prompt", pa.list_(msg)), ("activation_vector", pa.list_(pa.float32(), d)), ("doc_id", pa.string()),
                      ("activation_layer", pa.int64()), ("n_raw_tokens", pa.int64()), ("detokenized_text_truncated", pa.string()),
                      ("activation_token", pa.string())])


def _table(rows: list[dict], d: int, prompt):
    import pyarrow as pa

    schema = _schema(d)
    acts = np.stack([r["vector"] for r in rows]).astype(np.float32) if rows else np.zeros((0, d), np.float32)
    return pa.table({
        "prompt": pa.array([prompt] * len(rows), type=schema.field("prompt").type),
        "activation_vector": pa.FixedSizeListArray.from_arrays(pa.array(acts.reshape(-1), type=pa.float32()), d),
        "doc_id": pa.array([r["doc_id"] for r in rows], type=pa.string()),
        "activation_layer": pa.array([r["layer"] for r in rows], type=pa.int64()),
        "n_raw_tokens": pa.array([r["n_raw_tokens"] for r in rows], type=pa.int64()),
        "detokenized_text_truncated": pa.array([r["text"] for r in rows], type=pa.string()),
        "activation_token": pa.array([r["token"] for r in rows], type=pa.string()),
    }, schema=schema)


def _marker_tokens(tokenizer, marker: str, template: str) -> dict:
    """The marker's id and its neighbours in the rendered AV prompt (what the sidecar's tokens hold)."""
    from nla_grpo.shared.prompts import INJECT_PLACEHOLDER, render_av_ids

    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) != 1:
        raise NlaInputError("--injection-char", f"expected one token in this tokenizer, {marker!r} is {len(ids)}: {ids}")
    rendered = render_av_ids(tokenizer, [{"role": "user", "content": template.format(injection_char=INJECT_PLACEHOLDER)}], marker)
    sites = [p for p in range(1, len(rendered) - 1) if rendered[p] == ids[0]]
    if len(sites) != 1:
        raise NlaInputError("--injection-char", f"{marker!r} appears {len(sites)} times in the rendered AV prompt, expected once")
    p = sites[0]
    return {"injection_char": marker, "injection_token_id": int(ids[0]), "injection_left_neighbor_id": int(rendered[p - 1]),
            "injection_right_neighbor_id": int(rendered[p + 1]), "critic_suffix_ids": None}


@dataclass
class ChunkJob:
    """What a worker needs to extract its chunks (plain values: it travels to Ray tasks)."""

    corpus: str
    model: str
    layer: int
    positions_per_doc: int
    min_position: int
    max_docs: int | None
    shares: dict
    seed: int
    max_tokens: int
    batch_size: int
    chunk_docs: int
    device: str
    dtype: str
    work: str
    d_model: int


def _chunks(job: ChunkJob):
    chunk = []
    for i, doc_id, text in iter_corpus(Path(job.corpus)):
        if job.max_docs is not None and i >= job.max_docs:
            break
        chunk.append((doc_id, text))
        if len(chunk) == job.chunk_docs:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def run_chunks(job: ChunkJob, worker: int, workers: int, stop_after: int | None = None, on_chunk=None) -> tuple[int, bool]:
    """Extract every ``workers``-th chunk from ``worker`` on that is not done yet: its rows as one part
    file per split, then its done marker. Returns (documents too short, whether every chunk of this
    worker is done)."""
    import pyarrow.parquet as pq
    import torch

    from nla_grpo.shared.model_checks import load_tokenizer

    work = Path(job.work)
    tok = load_tokenizer(job.model)
    extractor = None
    prompt = [{"role": "user", "content": AV_TEMPLATE.format(injection_char="<INJECT>")}]
    skipped, ran = 0, 0
    for c, chunk in enumerate(_chunks(job)):
        if c % workers != worker or (work / "done" / f"chunk-{c:06d}").exists():
            continue
        if stop_after is not None and ran >= stop_after:
            return skipped, False
        if extractor is None:
            extractor = Extractor(Path(job.model), job.layer, job.device, getattr(torch, job.dtype))
        rows = {name: [] for name in job.shares}
        docs, short = [], 0
        for doc_id, text in chunk:
            enc = tok(text, add_special_tokens=True, return_offsets_mapping=True, truncation=True, max_length=job.max_tokens)
            pos = positions_for(doc_id, len(enc["input_ids"]), job.positions_per_doc, job.min_position, job.seed)
            if pos:
                docs.append((doc_id, text, list(enc["input_ids"]), enc["offset_mapping"], pos))
            else:
                short += 1
        skipped += short
        order = sorted(range(len(docs)), key=lambda k: len(docs[k][2]))  # length-sorted batches: little padding
        found = {}
        for b in range(0, len(order), job.batch_size):
            batch = order[b : b + job.batch_size]
            h = extractor.residuals([docs[k][2] for k in batch])
            for row, k in enumerate(batch):
                found[k] = [(p, h[row, p].numpy().copy()) for p in docs[k][4]]
        for k, (doc_id, text, ids, offsets, pos) in enumerate(docs):
            split = split_of(doc_id, job.shares, job.seed)
            for p, vec in found[k]:
                end = offsets[p][1] if offsets[p][1] else offsets[p - 1][1] if p else 0
                rows[split].append({"doc_id": doc_id, "vector": vec, "layer": job.layer, "n_raw_tokens": p + 1, "text": text[:end],
                                    "token": tok.decode([ids[p]])})
        for name in job.shares:  # each part appears whole or not at all, and the marker after all of them
            tmp = work / name / f".part-{c:06d}.tmp"
            pq.write_table(_table(rows[name], job.d_model, prompt), tmp, write_page_checksum=True)
            tmp.replace(work / name / f"part-{c:06d}.parquet")
        write_json(work / "done" / f"chunk-{c:06d}", {"skipped": short})
        ran += 1
        if on_chunk is not None:
            on_chunk()
    return skipped, True


def _run_on_ray(job: ChunkJob, workers: int, stop_after: int | None, progress) -> tuple[int, bool]:
    """One Ray task per worker (a GPU each on CUDA, a share of the cores on the CPU); progress from the
    done markers while they run."""
    import os

    import ray

    from nla_grpo.shared.ray_cluster import start_ray

    start_ray()
    gpu = job.device.startswith("cuda")
    if gpu:
        job = ChunkJob(**{**job.__dict__, "device": "cuda"})  # each task sees its own GPU as cuda:0
    threads = max(1, (os.cpu_count() or 1) // workers)

    def task(w):
        import torch

        torch.set_num_threads(threads)
        return run_chunks(job, w, workers, stop_after)

    remote = ray.remote(num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1, max_retries=0)(task)
    refs = [remote.remote(w) for w in range(workers)]
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, timeout=5.0)
            ray.get(ready)  # the first failure stops the others at once
            progress()
        results = ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        for ref in pending:
            ray.cancel(ref, force=True)
        cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
        raise cause from None
    return sum(r[0] for r in results), all(r[1] for r in results)


def extract(corpus, model_dir, layer: int, out_dir, positions_per_doc: int = 10, min_position: int = 50,
            max_docs: int | None = None, splits: str = "av_sft=0.25,ar_sft=0.25,rl=0.5", seed: int = 0,
            max_tokens: int = 512, batch_size: int = 16, chunk_docs: int = 256, device: str = "auto",
            injection_char: str = "※", injection_scale: str = "sqrt_d_model", mse_scale: str = "sqrt_d_model",
            workers: int = 1, log=print, stop_after_chunks: int | None = None) -> dict[str, Path]:
    """Write the splits into ``out_dir``; returns ``{split: parquet}``. ``workers`` > 1: one Ray task per
    GPU (or per CPU core share) over every ``workers``-th chunk. ``stop_after_chunks`` stops after that
    many chunks, as a kill would (for tests)."""
    import torch

    from nla_grpo.shared.model_checks import load_tokenizer, model_config_field
    from nla_grpo.shared.schema import resolve_scale

    corpus, model_dir, out = Path(corpus), Path(model_dir), Path(out_dir)
    shares = parse_splits(splits)
    for name, value, low in (("--positions-per-doc", positions_per_doc, 1), ("--min-position", min_position, 0),
                             ("--max-tokens", max_tokens, 2), ("--batch-size", batch_size, 1), ("--chunk-docs", chunk_docs, 1),
                             ("--workers", workers, 1)):
        if value < low:
            raise NlaInputError(name, f"expected at least {low}, found {value}")
    if min_position >= max_tokens:
        raise NlaInputError("--min-position", f"expected below --max-tokens ({max_tokens}): no position could be taken, "
                                              f"found {min_position}")
    if not model_dir.is_dir():
        raise NlaInputError(model_dir, "model directory not found (--model)")
    next(iter_corpus(corpus), None)  # the corpus opens and has its column, before the model loads
    blocks = model_config_field(model_dir, "num_hidden_layers")
    if blocks is not None and not 0 <= layer < blocks:
        raise NlaInputError("--layer", f"expected 0..{blocks - 1} ({model_dir} has {blocks} decoder blocks), found {layer}")
    d = model_config_field(model_dir, "hidden_size")
    tok = load_tokenizer(model_dir)
    tokens = _marker_tokens(tok, injection_char, AV_TEMPLATE)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    for name, value in (("--injection-scale", injection_scale), ("--mse-scale", mse_scale)):
        try:
            resolve_scale(value, d)
        except (TypeError, ValueError):
            raise NlaInputError(name, f"expected a positive number, 'sqrt_d_model' or 'raw', found {value!r}") from None
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    args = {"corpus": str(corpus.resolve()), "model": str(model_dir.resolve()), "layer": layer, "positions_per_doc": positions_per_doc,
            "min_position": min_position, "max_docs": max_docs, "splits": shares, "seed": seed, "max_tokens": max_tokens,
            "chunk_docs": chunk_docs, "injection_char": injection_char, "dtype": dtype, "batch_size": batch_size,
            "device": device}
    work = out / ".extract"
    state_path = work / STATE
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text())
            state["args"]
        except (ValueError, KeyError, TypeError):
            raise NlaInputError(state_path, "damaged (remove OUT_DIR/.extract to start again)") from None
        if state["args"] != args:
            changed = sorted(k for k in args if state["args"].get(k) != args[k])
            raise NlaInputError(out, f"an unfinished extraction with other arguments is here ({', '.join(changed)} differ): "
                                     "rerun it as it was, or choose another OUT_DIR")
        log(f"[extract] resuming: {len(list((work / 'done').glob('chunk-*')))} chunk(s) of {chunk_docs} documents done")
    elif out.exists() and any(p.name != ".extract" for p in out.iterdir()):
        raise NlaInputError(out, "exists and is not empty (choose a new OUT_DIR)")
    (work / "done").mkdir(parents=True, exist_ok=True)
    held = lock_directory(work, "another extraction is writing into this directory")  # until the merge is done
    write_json(state_path, {"args": args})
    done = {int(p.name.split("-")[1]) for p in (work / "done").glob("chunk-*")}
    for name in shares:
        (work / name).mkdir(exist_ok=True)
        for part in (work / name).glob("*part-*"):  # a chunk the kill interrupted: done again
            if part.suffix != ".parquet" or int(part.stem.split("-")[1]) not in done:
                part.unlink()
    job = ChunkJob(str(corpus), str(model_dir), layer, positions_per_doc, min_position, max_docs, shares, seed, max_tokens,
                   batch_size, chunk_docs, device, dtype, str(work), d)
    total = corpus_size(corpus) if max_docs is None else min(max_docs, corpus_size(corpus))
    t0, before = time.time(), len(done)

    def progress():
        n = len(list((work / "done").glob("chunk-*")))
        seen = min(total, n * chunk_docs)
        rate = (n - before) * chunk_docs / max(time.time() - t0, 1e-9)
        eta = (total - seen) / rate if rate > 0 else float("nan")
        log(f"[extract] {seen}/{total} documents | {rate:.1f} docs/s | ETA {eta:.0f} s")

    if workers == 1:
        _, finished = run_chunks(job, 0, 1, stop_after_chunks, on_chunk=progress)
    else:
        _, finished = _run_on_ray(job, workers, stop_after_chunks, progress)
    if not finished:
        return {}

    # ---- merge the parts in chunk order (the same whatever the workers), then the sidecars ----
    import pyarrow.parquet as pq
    import yaml

    from nla_grpo.shared.schema import fve_baselines, resolve_scale

    marks = sorted(int(m.name.split("-")[1]) for m in (work / "done").glob("chunk-*"))
    for name in shares:
        have = sorted(int(p.stem.split("-")[1]) for p in (work / name).glob("part-*.parquet"))
        if marks != list(range(len(marks))) or have != marks:
            raise NlaInputError(work, f"the parts of split {name} do not match the finished chunks (another extraction "
                                      "into this directory?): remove OUT_DIR/.extract and run again")
    skipped = sum(json.loads(m.read_text())["skipped"] for m in (work / "done").glob("chunk-*"))
    written = {}
    for name in shares:
        parts = sorted((work / name).glob("part-*.parquet"))
        target, tmp = out / f"{name}.parquet", out / f".{name}.parquet.tmp"
        writer = pq.ParquetWriter(tmp, _schema(d), write_page_checksum=True)
        count, sample = 0, []
        for part in parts:
            table = pq.read_table(part)
            if table.num_rows:
                writer.write_table(table)
                count += table.num_rows
                if sum(len(x) for x in sample) < 4000:  # rows for the FVE baselines, not every part
                    sample.append(np.asarray(table.column("activation_vector").combine_chunks().flatten()).reshape(-1, d))
        writer.close()
        if count == 0:
            tmp.unlink()
            log(f"[extract] split {name}: no rows (too few documents)")
            continue
        tmp.replace(target)
        golds = torch.from_numpy(np.concatenate(sample)[:4000])
        meannorm, rawvar = fve_baselines(golds, resolve_scale(mse_scale, d)) if len(golds) > 1 else (math.nan, math.nan)
        meta = {
            "kind": "nla_dataset", "schema_version": 1, "dataset_id": f"{name}_{corpus.stem}_L{layer}_seed{seed}",
            "stage": name, "row_count": count,
            "extraction": {"base_model": str(model_dir.resolve()), "d_model": d, "layer_index": layer, "norm": "none",
                           "corpus": corpus.stem, "corpus_slice": {"start": 0, "length": total},
                           "positions_per_doc": positions_per_doc},
            "tokens": tokens,
            "prompt_templates": {"actor": AV_TEMPLATE, "critic": AR_TEMPLATE},
            "injection_scale": injection_scale, "mse_scale": mse_scale,
            "fve_baseline": {"rawvar": round(float(rawvar), 6), "meannorm": round(float(meannorm), 6)},
        }
        (out / f"{name}.parquet.nla_meta.yaml").write_text(yaml.safe_dump(meta, sort_keys=False, allow_unicode=True), encoding="utf-8")
        written[name] = target
    if "rl" not in written:
        raise NlaInputError(corpus, f"no rl rows: every document is shorter than --min-position ({min_position} tokens) "
                                    "or went to another split")
    held.close()
    shutil.rmtree(work)
    log(f"[extract] {', '.join(f'{n}: {pq.ParquetFile(p).metadata.num_rows} rows' for n, p in written.items())}"
        f" ({skipped} documents shorter than --min-position skipped)")
    return written


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `nla-grpo data extract`")
