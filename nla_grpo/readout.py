"""``nla-grpo read``: documents -> one record per read position -> ``DIR/readout.parquet``, ``DIR/documents.parquet``
and ``DIR/readout.html``.

Every document read is journaled (``DIR/.read/``) before the next starts, and each position's samples are drawn from
a seed of (run seed, document, position), so a killed run, run again, continues where it stopped and writes what a
straight run writes. The journal records the arguments; a rerun with other ones is refused in one line. Inputs are
checked before anything is written.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from nla_grpo.shared.errors import NlaInputError

JOURNAL_DIR = ".read"
READOUT, DOCUMENTS, PAGE = "readout.parquet", "documents.parquet", "readout.html"


def add_arguments(p) -> None:
    p.add_argument("nla", help="a pipeline run, an RL run (its newest checkpoint) or an exported NLA")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", metavar="FILE", help="one document: a UTF-8 text file, or - for standard input")
    src.add_argument("--corpus", metavar="PARQUET_OR_JSONL", help="documents: a 'text' column or field, optional 'doc_id'")
    p.add_argument("--positions", default="all", help="which tokens of each document: all, stride:K or from:N")
    p.add_argument("--samples", type=int, default=1, help="explanations per position; the readout keeps the one the "
                                                          "reconstructor reads best, and all of them")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (a position's samples depend on it, its document and its index)")
    p.add_argument("--max-tokens", type=int, default=512, help="documents are cut to this many tokens")
    p.add_argument("--max-docs", type=int, help="read only the corpus's first documents")
    p.add_argument("--text-column", default="text", help="the corpus's text column")
    p.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda, cuda:N or cpu")
    p.add_argument("--backend", default="auto", choices=("auto", "hf", "vllm"),
                   help="the verbaliser's engine: auto = vLLM on a GPU, HF generate() on the CPU")
    p.add_argument("--out", required=True, help="output directory (new, or a killed read's to continue it)")


def _documents(args) -> list[tuple[str, str]]:
    """``[(doc_id, text)]``, every one checked before any is read."""
    if args.text is not None:
        if args.text == "-":
            text = sys.stdin.read()
            name = "stdin"
        else:
            path = Path(args.text)
            if not path.is_file():
                raise NlaInputError(path, "text file not found")
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise NlaInputError(path, "not UTF-8 text") from None
            name = path.stem
        if not text.strip():
            raise NlaInputError(args.text, "empty text")
        return [(name, text)]
    from nla_grpo.dataprep.extract import iter_corpus

    docs = []
    for i, doc_id, text in iter_corpus(Path(args.corpus), args.text_column):
        if args.max_docs is not None and i >= args.max_docs:
            break
        docs.append((doc_id, text))
    if not docs:
        raise NlaInputError(args.corpus, "no documents")
    return docs


def _settings(args, nla) -> dict:
    return {"nla": str(Path(args.nla).resolve()), "nla_source": nla.parts.source,
            "input": "stdin" if args.text == "-" else str(Path(args.text or args.corpus).resolve()),
            "positions": args.positions, "samples": args.samples, "seed": args.seed, "max_tokens": args.max_tokens,
            "max_docs": args.max_docs, "text_column": args.text_column}


class Journal:
    """``DIR/.read/``: the settings, then one JSON line per document read (its tokens and records)."""

    def __init__(self, out: Path):
        self.dir = out / JOURNAL_DIR
        self.settings_path, self.lines_path = self.dir / "settings.json", self.dir / "documents.jsonl"

    def open(self, settings: dict) -> dict[int, dict]:
        """The documents already read (index -> entry); a journal of other settings is refused."""
        if self.settings_path.is_file():
            then = json.loads(self.settings_path.read_text(encoding="utf-8"))
            for key in sorted(set(then) | set(settings)):
                if then.get(key) != settings.get(key):
                    raise NlaInputError(self.settings_path.parent.parent, f"{key}: {then.get(key)!r} in the read this directory "
                                                                          f"continues, {settings.get(key)!r} now (use another --out)")
        done = {}
        if self.lines_path.is_file():
            raw = self.lines_path.read_bytes()
            good = raw[: raw.rfind(b"\n") + 1]  # a line cut by a kill is dropped and read again
            for line in good.decode("utf-8").splitlines():
                entry = json.loads(line)
                done[int(entry["doc_index"])] = entry
            if len(good) != len(raw):
                self.lines_path.write_bytes(good)
        return done

    def start(self, settings: dict) -> None:
        if not self.settings_path.is_file():
            from nla_grpo.shared.fileio import write_json

            self.dir.mkdir(parents=True, exist_ok=True)
            write_json(self.settings_path, settings)

    def append(self, entry: dict) -> None:
        with open(self.lines_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())


class Progress:
    """``[read] [#####.....] 12/40 documents | 384 positions | 31.5 positions/s | eta 0:00:09``: at most every 2 s
    (and at the end), on one line rewritten in a terminal, a line each otherwise."""

    def __init__(self, total_docs: int, log, every: float = 2.0):
        self.total, self.log, self.every = total_docs, log, every
        self.t0, self.last, self.positions, self.tty = time.time(), 0.0, 0, sys.stdout.isatty()
        self.shown = None

    def update(self, docs_done: int, new_positions: int, final: bool = False) -> None:
        self.positions += new_positions
        now = time.time()
        if (not final and now - self.last < self.every) or (final and self.shown == (docs_done, self.positions) and not self.tty):
            return
        self.last, self.shown = now, (docs_done, self.positions)
        rate = self.positions / max(now - self.t0, 1e-9)
        share = docs_done / max(self.total, 1)
        left = (now - self.t0) / share - (now - self.t0) if share > 0 else float("nan")
        from nla_grpo.orchestrator.driver import clock

        bar = "#" * round(20 * share) + "." * (20 - round(20 * share))
        line = (f"[read] [{bar}] {docs_done}/{self.total} documents | {self.positions} positions | {rate:.1f} positions/s"
                + (f" | eta {clock(left)}" if not final and math.isfinite(left) else ""))
        if self.tty and not final:
            print("\r" + line, end="", flush=True)
        else:
            print(("\r" if self.tty else "") + line, flush=True)


def _write_parquet_atomic(path: Path, table) -> None:
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def readout_table(records: list[dict]):
    import pyarrow as pa

    cols = {
        "doc_index": pa.array([r["doc_index"] for r in records], type=pa.int64()),
        "doc_id": pa.array([r["doc_id"] for r in records], type=pa.string()),
        "token_index": pa.array([r["token_index"] for r in records], type=pa.int64()),
        "token": pa.array([r["token"] for r in records], type=pa.string()),
        "explanation": pa.array([r["explanation"] for r in records], type=pa.string()),
        "mse": pa.array([r["mse"] for r in records], type=pa.float64()),
        "fve": pa.array([r["fve"] for r in records], type=pa.float64()),
        "explanations": pa.array([r["explanations"] for r in records], type=pa.list_(pa.string())),
        "mses": pa.array([r["mses"] for r in records], type=pa.list_(pa.float64())),
    }
    return pa.table(cols)


def run_read(args, log=print) -> int:
    from nla_grpo.nla import NLA, parse_positions, positions_of
    from nla_grpo.shared.ray_cluster import quiet_env

    quiet = quiet_env()  # vLLM's start-up chatter and library warnings, as in a run's services (NLA_GRPO_VERBOSE=1 keeps them)
    os.environ.update(quiet)
    if "PYTHONWARNINGS" in quiet:
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise NlaInputError(out, "exists and is not a directory")
    if (out / READOUT).exists():
        raise NlaInputError(out, f"already holds a finished {READOUT} (choose another --out)")
    if out.is_dir() and any(out.iterdir()) and not (out / JOURNAL_DIR).is_dir():
        raise NlaInputError(out, "exists and is not empty (choose another --out)")
    positions = parse_positions(args.positions)
    if args.samples < 1:
        raise NlaInputError("--samples", f"expected >= 1, found {args.samples}")
    if args.max_tokens < 1:
        raise NlaInputError("--max-tokens", f"expected >= 1, found {args.max_tokens}")
    docs = _documents(args)
    device = None if args.device == "auto" else args.device
    nla = NLA.load(args.nla, device=device, backend=args.backend, max_tokens=args.max_tokens)
    log(f"[read] {nla.describe()}")
    lengths = [len(nla.tokens(text)) for _, text in docs]
    wanted = [positions_of(n, positions) for n in lengths]
    if not any(wanted):
        first = positions[1] if positions[0] == "from" else 0
        where = args.text if args.text is not None else args.corpus
        raise NlaInputError(where, f"{max(lengths)} tokens, shorter than the first position asked ({args.positions}: token {first})"
                            if len(docs) == 1 else f"no document reaches the first position asked ({args.positions}); "
                                                   f"the longest has {max(lengths)} tokens")
    short = sum(1 for w in wanted if not w)
    settings = _settings(args, nla)
    journal = Journal(out)
    created = not out.exists()
    done = journal.open(settings) if out.is_dir() else {}
    if done:
        log(f"[read] continuing: {len(done)} of {len(docs)} documents already read in {out / JOURNAL_DIR}")
    log(f"[read] {len(docs)} document(s), {sum(len(w) for w in wanted)} positions ({args.positions}), {args.samples} "
        f"sample(s) each" + (f"; {short} document(s) shorter than the first position are skipped" if short else ""))
    progress = Progress(len(docs), log)
    try:
        for d, (doc_id, text) in enumerate(docs):
            if d in done or not wanted[d]:
                continue
            pieces, records = nla.read_document(text, positions, args.samples, args.seed, doc_index=d, doc_id=doc_id)
            journal.start(settings)
            entry = {"doc_index": d, "doc_id": doc_id, "tokens": pieces, "records": records}
            journal.append(entry)
            done[d] = entry
            progress.update(len(done), len(records))
    except NlaInputError:
        if created:
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        nla.close()
    progress.update(len(done), 0, final=True)

    # ---- outputs: each appears whole; the journal goes last ----
    import pyarrow as pa

    entries = [done[d] for d in sorted(done)]
    records = [r for e in entries for r in e["records"]]
    documents = [{"doc_index": e["doc_index"], "doc_id": e["doc_id"], "tokens": e["tokens"]} for e in entries]
    out.mkdir(parents=True, exist_ok=True)
    _write_parquet_atomic(out / DOCUMENTS, pa.table({
        "doc_index": pa.array([e["doc_index"] for e in documents], type=pa.int64()),
        "doc_id": pa.array([e["doc_id"] for e in documents], type=pa.string()),
        "tokens": pa.array([e["tokens"] for e in documents], type=pa.list_(pa.string()))}))
    from nla_grpo.page import render

    about = (f"{nla.parts.source} · layer {nla.spec.layer_index} · {args.samples} sample(s) per position, the best shown first "
             f"· FVE = 1 − MSE / {nla.fve_baseline:.4f} (predicting the mean scores 0)")
    tmp = out / f".{PAGE}.tmp"
    tmp.write_text(render(documents, records, f"NLA readout: {Path(args.text or args.corpus).name}", about), encoding="utf-8")
    tmp.replace(out / PAGE)
    _write_parquet_atomic(out / READOUT, readout_table(records))
    import shutil

    shutil.rmtree(out / JOURNAL_DIR, ignore_errors=True)
    fves = [r["fve"] for r in records if r["fve"] is not None]
    log(f"[read] {len(records)} positions of {len(documents)} document(s): mean FVE "
        f"{(sum(fves) / len(fves) if fves else float('nan')):+.3f}; {out / READOUT}, {out / PAGE}")
    return 0
