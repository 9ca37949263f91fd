"""``nla-grpo data explain``: a teacher LLM's explanation for every row of the SFT splits.

What the teacher is asked (the second stage of an NLA, as in the official release): it sees the
document up to the position where the activation was read, with that token marked ``⟦token⟧`` at the
end, and writes what the subject model is representing there: the concept, topic or meaning of the
marked token in its context, and what it suggests comes next. The answer is ONE short explanation (a
phrase to one sentence, a few words to about 25), inside ``<explanation>…</explanation>`` and nothing
else. Short because the verbaliser learns to write it after "Describe the concept … in a few words."
and the reconstructor reads it back: an essay would teach neither. ``PROMPT_VERSION`` names this
prompt; it is recorded in the output's sidecar and a resume with another one is refused.

A reply that is empty, lacks the tags, refuses ("I can't…", "I'm sorry…") or is a long multi-line
essay is asked again (``answer_retries`` times, at temperature 1.0 after a first ask at 0), then
dropped and counted, never kept. A teacher that drops the first 16 rows of a split (all of them, if
fewer) is taken to refuse the task: the run stops in one line rather than pay for a whole split of
refusals. A 401/403/404 on a request stops it at once; timeouts and 5xx are retried by the client, and
a row that still gets no answer is left unanswered for the next run (never dropped for a network fault).

Streaming and resumable: each answer, kept or dropped, is appended to ``DIR/.explain/<split>/
shard-NNNNNN.jsonl`` and fsync'd as it arrives, so a killed run loses only the requests in flight; a
rerun reads the journal (a torn last line is ignored) and asks only the rows not in it. The arguments
that shape the answers (model, API, prompt version, ``max_rows``, the source files) are pinned in
``.explain/state.json``. When every row of a split is answered, ``DIR/<split>.explained.parquet`` (the
source columns plus ``explanation``, source order, dropped rows left out) and its sidecar (the
source's, ``row_count`` the rows kept, plus an ``explanations:`` record) are written atomically;
``.explain/`` goes when every split is written.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.fileio import lock_directory

PROMPT_VERSION = 1
TEXT_COLUMN = "detokenized_text_truncated"
TOKEN_COLUMN = "activation_token"
OUT_SUFFIX = ".explained.parquet"
WORK = ".explain"
SHARD_ROWS = 1024
GUARD_ROWS = 16  # a teacher that drops this many first rows of a split refuses the task
MAX_CONTEXT_CHARS = 4000  # the context's tail the teacher sees (the marked token is at its end)
MAX_EXPLANATION_CHARS = 400
OPEN_MARK, CLOSE_MARK = "⟦", "⟧"

SYSTEM = ("You are an interpretability assistant. A language model read a document one token at a time; at one "
          "token, its internal activation was recorded. You describe, briefly, what the model is representing at "
          "that token.")
USER = """The document up to the recorded token; that token is marked {open_}like this{close} at the very end:

<document>
{context}
</document>

In a few words (a phrase or one short sentence, at most about 25 words), say what the model is representing at \
the marked token: the concept, topic or meaning of that token in this context, and what it suggests comes next.
Answer as <explanation>your explanation</explanation> and nothing else."""
_REFUSAL = re.compile(r"^\W*(i can['’]?t|i cannot|i can not|i['’]?m sorry|i am sorry|sorry|as an ai|i won['’]?t|"
                      r"i will not|i['’]?m unable|i am unable|i['’]?m not able|i am not able|unfortunately,? i)\b", re.I)


# ---- the prompt and the reply ----
def teacher_prompt(text: str, token: str | None = None) -> tuple[str, str]:
    """``(system, user)`` for one row: ``text`` (the document up to and including the activation's token)
    with ``token`` marked at its end; when ``token`` is missing or does not end ``text``, the marker
    ``⟦⟧`` sits right after the text. Leading whitespace of the token stays outside the marker."""
    text = text or ""
    if token and text.endswith(token):
        body = token.lstrip() or token
        before = text[: len(text) - len(body)]
    else:
        body, before = "", text
    if len(before) > MAX_CONTEXT_CHARS:
        before = "…" + before[len(before) - MAX_CONTEXT_CHARS:]
    context = f"{before}{OPEN_MARK}{body}{CLOSE_MARK}"
    return SYSTEM, USER.format(open_=OPEN_MARK, close=CLOSE_MARK, context=context)


def classify_reply(text: str | None) -> tuple[str | None, str]:
    """``(explanation, "ok")`` or ``(None, why)`` with why one of empty, refusal, no_tags, too_long. The
    kept explanation has its whitespace collapsed to single spaces (it goes into one-line templates)."""
    from nla_grpo.shared.schema import extract_explanation

    raw = (text or "").strip()
    if not raw:
        return None, "empty"
    payload = extract_explanation(raw)
    if payload is None:
        return None, "refusal" if _REFUSAL.match(raw) else "no_tags"
    if not payload:
        return None, "empty"
    if _REFUSAL.match(payload):
        return None, "refusal"
    if len(payload) > MAX_EXPLANATION_CHARS and ("\n" in payload or len(payload) > 2.5 * MAX_EXPLANATION_CHARS):
        return None, "too_long"
    return " ".join(payload.split()), "ok"


def parse_teacher_reply(text: str | None) -> str | None:
    """The reply's ``<explanation>`` payload, or None (empty, no tags, a refusal, an essay)."""
    return classify_reply(text)[0]


# ---- the work directory ----
def _fingerprint(path: Path, rows: int) -> dict:
    """Size, row count and a hash of the first and last 64 KiB: a copy or a touch keeps it, new data does not."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 16))
        f.seek(max(0, size - (1 << 16)))
        h.update(f.read(1 << 16))
    return {"size": size, "rows": rows, "sha256_ends": h.hexdigest()[:16]}


def _pin(work: Path, args: dict) -> None:
    """Record the arguments in ``state.json``, or refuse a resume whose arguments differ."""
    from nla_grpo.shared.fileio import write_json

    path = work / "state.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))["args"]
            old["sources"]
        except (ValueError, KeyError, TypeError):
            raise NlaInputError(path, f"damaged (delete {work} to start again)") from None
        changed = sorted(k for k in args if k != "sources" and old.get(k) != args[k])
        changed += sorted(f"source {s}" for s, fp in args["sources"].items() if s in old["sources"] and old["sources"][s] != fp)
        if changed:
            raise NlaInputError(work, f"an unfinished run with other arguments is here ({', '.join(changed)} differ): "
                                      f"rerun it with the same arguments, or delete {work} to start again")
        args = {**args, "sources": {**old["sources"], **args["sources"]}}
    write_json(path, {"args": args})


def _read_journal(split_dir: Path, split: str, n: int) -> dict[int, dict]:
    """``{row: record}`` from the shards; a torn last line (a kill mid-write) is ignored."""
    done: dict[int, dict] = {}
    for shard in sorted(split_dir.glob("shard-*.jsonl")):
        lines = shard.read_bytes().split(b"\n")
        for k, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                row = rec["row"]
                ok = rec.get("split") == split and isinstance(row, int) and 0 <= row < n
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                if k == len(lines) - 1:  # the last line, no newline after it: torn
                    continue
                raise NlaInputError(shard, f"line {k + 1}: not a journal record of split {split} with a row below {n} "
                                           f"(delete {split_dir.parent} to start again)")
            done.setdefault(row, rec)
    return done


class _Journal:
    """Appends records to new shards of ``split_dir`` (one per ``SHARD_ROWS`` records), each flushed and
    fsync'd as it is written."""

    def __init__(self, split_dir: Path):
        split_dir.mkdir(parents=True, exist_ok=True)
        names = [int(p.stem.split("-")[1]) for p in split_dir.glob("shard-*.jsonl")]
        self.dir, self.next, self.f, self.count = split_dir, max(names, default=-1) + 1, None, 0

    def append(self, rec: dict) -> None:
        if self.f is None or self.count == SHARD_ROWS:
            self.close()
            self.f = open(self.dir / f"shard-{self.next:06d}.jsonl", "a", encoding="utf-8")
            self.next, self.count = self.next + 1, 0
        self.f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.count += 1

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


# ---- inputs and outputs ----
def _open_split(splits_dir: Path, split: str, max_rows: int | None):
    """The split's parquet (checked: it opens, has the text column, has no explanation yet), its sidecar
    path and the rows to explain."""
    import pyarrow.parquet as pq

    from nla_grpo.shared.spec import load_spec, sidecar_path

    src = splits_dir / f"{split}.parquet"
    if not src.is_file():
        raise NlaInputError(src, f"split {split} not found (expected {split}.parquet from `nla-grpo data extract`)")
    side = sidecar_path(src)
    if not side.is_file():
        raise NlaInputError(side, "sidecar not found (expected <parquet>.nla_meta.yaml beside the parquet)")
    load_spec(side)
    try:
        pf = pq.ParquetFile(src)
    except Exception as exc:  # noqa: BLE001 - whatever pyarrow says, it is one line about this file
        raise NlaInputError(src, f"not a parquet file ({(str(exc).splitlines() or [''])[0][:80]})") from None
    names = pf.schema_arrow.names
    if TEXT_COLUMN not in names:
        raise NlaInputError(src, f"column {TEXT_COLUMN!r} missing (found {names}): the teacher needs the document text")
    if "explanation" in names:
        raise NlaInputError(src, "already has an 'explanation' column (expected a split from `nla-grpo data extract`)")
    rows = pf.metadata.num_rows
    return src, side, rows if max_rows is None else min(rows, max_rows)


def _texts(src: Path, n: int) -> tuple[list[str], list[str | None]]:
    import pyarrow.parquet as pq

    names = pq.ParquetFile(src).schema_arrow.names
    cols = [TEXT_COLUMN] + ([TOKEN_COLUMN] if TOKEN_COLUMN in names else [])
    table = pq.read_table(src, columns=cols).slice(0, n)
    texts = table.column(TEXT_COLUMN).to_pylist()
    tokens = table.column(TOKEN_COLUMN).to_pylist() if TOKEN_COLUMN in cols else [None] * n
    return texts, tokens


def _complete(dst: Path) -> dict | None:
    """The ``explanations`` record of a finished output, or None when it is missing or partial."""
    import pyarrow.parquet as pq
    import yaml

    from nla_grpo.shared.spec import sidecar_path

    try:
        rec = (yaml.safe_load(sidecar_path(dst).read_text(encoding="utf-8")) or {}).get("explanations") or {}
        return rec if rec.get("rows_kept") == pq.ParquetFile(dst).metadata.num_rows else None
    except Exception:  # noqa: BLE001 - anything unreadable is not finished
        return None


def _write_output(src: Path, side: Path, dst: Path, n: int, answers: dict[int, dict], record: dict) -> None:
    """``dst`` (rows ``[0, n)`` of ``src`` that kept an explanation, plus that column) and its sidecar,
    each atomically: the sidecar first, so a finished parquet always has its record beside it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from nla_grpo.shared.fileio import atomic_write, write_text
    from nla_grpo.shared.spec import sidecar_path

    meta = yaml.safe_load(side.read_text(encoding="utf-8"))
    meta["row_count"] = record["rows_kept"]
    meta["explanations"] = record
    write_text(sidecar_path(dst), yaml.safe_dump(meta, sort_keys=False, allow_unicode=True))
    pf = pq.ParquetFile(src)
    schema = pf.schema_arrow.append(pa.field("explanation", pa.string()))

    def write(tmp):
        with pq.ParquetWriter(tmp, schema, write_page_checksum=True) as writer:
            start = 0
            for batch in pf.iter_batches(batch_size=SHARD_ROWS):
                if start >= n:
                    break
                batch = batch.slice(0, n - start)
                said = [answers[start + i]["explanation"] for i in range(batch.num_rows)]
                keep = pa.array([s is not None for s in said])
                table = pa.Table.from_batches([batch]).append_column("explanation", pa.array(said, pa.string()))
                writer.write_table(table.filter(keep))
                start += batch.num_rows

    atomic_write(dst, write)


# ---- asking ----
def _ask_row(client, text: str, token: str | None, answer_retries: int) -> dict:
    """One row: asked until a usable explanation (at most ``1 + answer_retries`` times). A request that
    fails (after the client's own retries) returns ``error``/``status`` and leaves the row unanswered."""
    system, user = teacher_prompt(text, token)
    rec = {"explanation": None, "tokens_in": 0, "tokens_out": 0, "attempts": 0, "refusal": False, "reply": None}
    for attempt in range(answer_retries + 1):
        reply = client.chat(system, user, temperature=0.0 if attempt == 0 else 1.0)
        rec["tokens_in"] += reply.tokens_in
        rec["tokens_out"] += reply.tokens_out
        if reply.error is not None:
            return {**rec, "error": reply.error, "status": reply.status}
        rec["attempts"] += 1
        explanation, why = classify_reply(reply.text)
        if explanation is not None:
            return {**rec, "explanation": explanation}
        rec["refusal"], rec["why"], rec["reply"] = why == "refusal", why, (reply.text or "")[:200]
    return rec


def _explain_split(client, split: str, src: Path, n: int, work: Path, answer_retries: int, log, progress: bool) -> dict:
    """Ask every row of ``split`` not in its journal; returns ``{row: record}`` for all ``n`` rows."""
    from tqdm import tqdm

    split_dir = work / split
    done = _read_journal(split_dir, split, n)
    pending = [i for i in range(n) if i not in done]
    if done:
        log(f"[explain] {split}: resuming, {len(done)} of {n} rows answered")
    texts, tokens = _texts(src, n)
    journal = _Journal(split_dir)
    guard = min(GUARD_ROWS, n)
    failed, in_a_row, last_error = 0, 0, None
    bar = tqdm(total=n, initial=len(done), desc=f"explain {split}", unit="row", file=sys.stderr, dynamic_ncols=True,
               disable=not (progress and sys.stderr.isatty()))
    answers = client.imap_unordered(lambda i: _ask_row(client, texts[i], tokens[i], answer_retries), pending)
    try:
        for i, rec in answers:
            if "error" in rec:
                if rec["status"] in (401, 403, 404):
                    hint = ("check --base-url and --model" if rec["status"] == 404 else
                            f"key from {client.api_key_env}" if client.api_key_env else "no --api-key-env given")
                    raise NlaInputError("--base-url", f"the teacher at {client.chat_url} refuses the request: "
                                                      f"{_one(client.masked(rec['error'], 160))} ({hint})")
                failed, in_a_row, last_error = failed + 1, in_a_row + 1, _one(rec["error"])
                if in_a_row >= GUARD_ROWS:
                    raise NlaInputError("--base-url", f"the teacher at {client.chat_url} failed {in_a_row} requests in a row "
                                                      f"(last: {last_error}); rerun to continue")
                continue
            in_a_row = 0
            rec = {"split": split, "row": i, **rec}
            journal.append(rec)
            done[i] = rec
            bar.update(1)
            if len(done) >= guard > 0 and not any(r["explanation"] is not None for r in done.values()):
                raise NlaInputError("--base-url", f"the teacher at {client.chat_url} refused or gave no usable explanation "
                                                  f"for the first {len(done)} rows of {split} "
                                                  f"(last reply: {client.masked(repr(rec['reply']), 160)})")
    finally:
        answers.close()  # an abort: nothing more is asked
        bar.close()
        journal.close()
    if failed:
        raise NlaInputError("--base-url", f"{failed} of {n} rows of {split} got no answer from the teacher at "
                                          f"{client.chat_url} (last: {last_error}): run the same command again to ask them")
    return done


def _one(text: str) -> str:
    """A server's error text (an HTML page, say) on one line."""
    return " ".join(str(text).split())


DROP_REASONS = ("empty", "refusal", "no_tags", "too_long")
"""Why a row's last reply was not kept (``classify_reply``), in the order the summary names them."""
USAGE_KEYS = ("rows_in", "rows_kept", "dropped", "refusals", "tokens_in", "tokens_out") + tuple(f"dropped_{w}" for w in DROP_REASONS)


def _usage(answers: dict[int, dict]) -> dict:
    kept = sum(r["explanation"] is not None for r in answers.values())
    lost = [r for r in answers.values() if r["explanation"] is None]
    # a journal written before rows recorded why: its refusals are known, the rest counted as no_tags
    why = [r.get("why") or ("refusal" if r.get("refusal") else "no_tags") for r in lost]
    return {"rows_in": len(answers), "rows_kept": kept, "dropped": len(answers) - kept,
            "refusals": why.count("refusal"),
            "tokens_in": sum(r["tokens_in"] for r in answers.values()),
            "tokens_out": sum(r["tokens_out"] for r in answers.values()),
            **{f"dropped_{w}": why.count(w) for w in DROP_REASONS}}


def _line(name: str, u: dict) -> str:
    reasons = ", ".join(f"{u.get(f'dropped_{w}', 0)} {w.replace('_', ' ')}" for w in DROP_REASONS if u.get(f"dropped_{w}"))
    if u["dropped"] and not reasons:  # a split written before the reasons were recorded
        reasons = f"{u['refusals']} refusals"
    return (f"[explain] {name}: {u['rows_in']} rows, {u['rows_kept']} kept, {u['dropped']} dropped"
            + (f" ({reasons})" if u["dropped"] else "") + f", tokens in {u['tokens_in']}, out {u['tokens_out']}")


def explain_splits(splits_dir, *, base_url: str, model: str, api: str = "openai", api_key_env: str | None = None,
                   concurrency: int = 8, max_rows: int | None = None, timeout_s: float = 120, retries: int = 3,
                   answer_retries: int = 2, max_tokens: int = 256, splits=("av_sft", "ar_sft"), log=print,
                   progress: bool = True) -> dict:
    """Write ``<split>.explained.parquet`` (+ sidecar) for each of ``splits`` in ``splits_dir``; returns the
    usage ``{split: {rows_in, rows_kept, dropped, refusals, tokens_in, tokens_out}, "total": {...}}``."""
    from nla_grpo.evals.chat_client import ChatClient

    splits_dir = Path(splits_dir)
    for name, value, low in (("--concurrency", concurrency, 1), ("--max-rows", 1 if max_rows is None else max_rows, 1),
                             ("--retries", retries, 0), ("--max-tokens", max_tokens, 1), ("answer_retries", answer_retries, 0)):
        if value < low:
            raise NlaInputError(name, f"expected at least {low}, found {value}")
    if not timeout_s > 0:
        raise NlaInputError("--timeout-s", f"expected a positive number of seconds, found {timeout_s}")
    if api not in ("openai", "anthropic"):
        raise NlaInputError("--api", f"expected openai or anthropic, found {api!r}")
    if not splits_dir.is_dir():
        raise NlaInputError(splits_dir, "not a directory (expected the OUT_DIR of `nla-grpo data extract`)")
    inputs = {s: _open_split(splits_dir, s, max_rows) for s in splits}
    usage, todo = {}, []
    for s in splits:
        dst = splits_dir / f"{s}{OUT_SUFFIX}"
        rec = _complete(dst) if dst.is_file() else None
        if rec is not None:
            usage[s] = {k: rec.get(k, 0) for k in USAGE_KEYS}
            log(f"[explain] {s}: {dst.name} is already complete ({rec.get('rows_kept')} rows, by {rec.get('teacher_model')}); "
                "skipped (delete it to ask again)")
        else:
            todo.append(s)
    if todo:
        client = ChatClient(api, base_url, model, api_key_env=api_key_env, concurrency=concurrency, timeout_s=timeout_s,
                            retries=retries, max_tokens=max_tokens, temperature=0.0, where="--base-url",
                            key_where="--api-key-env", role="teacher")
        try:
            client.check()
            usage.update(_run(client, splits_dir, todo, inputs, model, api, max_rows, answer_retries, log, progress))
        finally:
            client.close()
    total = {k: sum(u.get(k, 0) for u in usage.values()) for k in USAGE_KEYS}
    for s in splits:
        log(_line(s, usage[s]))
    log(_line("total", total))
    return {**{s: usage[s] for s in splits}, "total": total}


def _run(client, splits_dir: Path, todo: list[str], inputs: dict, model: str, api: str, max_rows, answer_retries: int,
         log, progress: bool) -> dict:
    """The splits in ``todo``, under the work directory's lock; it goes when all are written, or when this
    run made it and a teacher problem stopped it before anything was kept."""
    work = splits_dir / WORK
    created = not work.exists()
    work.mkdir(exist_ok=True)
    held = lock_directory(work, "another `data explain` is running on this directory")
    usage = {}
    try:
        sources = {s: _fingerprint(inputs[s][0], inputs[s][2]) for s in todo}
        _pin(work, {"model": model, "api": api, "prompt_version": PROMPT_VERSION, "max_rows": max_rows, "sources": sources})
        for s in todo:
            src, side, n = inputs[s]
            answers = _explain_split(client, s, src, n, work, answer_retries, log, progress)
            usage[s] = _usage(answers)
            record = {"teacher_api": api, "teacher_model": model, "teacher_base_url": client.base_url,
                      "prompt_version": PROMPT_VERSION, "source": src.name, **usage[s]}
            _write_output(src, side, splits_dir / f"{s}{OUT_SUFFIX}", n, answers, record)
    except NlaInputError:
        if created and not _kept_any(work, todo):
            held.close()
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        held.close()
    shutil.rmtree(work, ignore_errors=True)
    return usage


def journaled_rows(splits_dir) -> int:
    """Rows answered and journaled under ``splits_dir/.explain`` (0 when there is none or it cannot be read)."""
    work = Path(splits_dir) / WORK
    try:
        return sum(len(_read_journal(d, d.name, 1 << 62)) for d in work.iterdir() if d.is_dir())
    except (NlaInputError, OSError):
        return 0


def _kept_any(work: Path, splits) -> bool:
    """Whether any journal record under ``work`` kept an explanation (a damaged journal counts as yes)."""
    try:
        return any(r.get("explanation") for s in splits for r in _read_journal(work / s, s, 1 << 62).values())
    except (NlaInputError, OSError):
        return True


# ---- the command ----
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``nla-grpo data explain``."""
    parser.add_argument("splits_dir", help="the OUT_DIR of `nla-grpo data extract` (holds av_sft.parquet, ar_sft.parquet)")
    parser.add_argument("--base-url", help="the teacher's API, e.g. http://127.0.0.1:8000/v1 or https://api.anthropic.com")
    parser.add_argument("--model", help="the teacher model's name at that API")
    parser.add_argument("--teacher", choices=("fixture",), default=None,
                        help="fixture: the tiny fixture's rule (the explanation is the marked token), served on loopback "
                             "instead of --base-url/--model; for `nla-grpo data tiny` data only, never for real data")
    parser.add_argument("--api", choices=("openai", "anthropic"), default="openai",
                        help="OpenAI-compatible chat completions or Anthropic Messages (default: openai)")
    parser.add_argument("--api-key-env", metavar="VAR", default=None, help="the environment variable holding the key")
    parser.add_argument("--concurrency", metavar="K", type=int, default=8, help="requests in flight")
    parser.add_argument("--max-rows", metavar="N", type=int, default=None, help="explain only the first N rows of each split")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    parser.add_argument("--retries", type=int, default=3, help="retries of a request on timeouts, 429 and 5xx")
    parser.add_argument("--max-tokens", type=int, default=256, help="the teacher's reply cap")


def teacher_arguments(teacher: str | None, base_url: str | None, model: str | None) -> None:
    """Either ``--teacher fixture`` or both ``--base-url`` and ``--model`` (one line otherwise)."""
    if teacher is not None:
        for flag, value in (("--base-url", base_url), ("--model", model)):
            if value:
                raise NlaInputError(flag, f"--teacher {teacher} is its own teacher: expected no {flag}, found {value!r}")
        return
    for flag, value in (("--base-url", base_url), ("--model", model)):
        if not value:
            raise NlaInputError(flag, f"the teacher's {flag.removeprefix('--').replace('-', ' ')} is needed "
                                      "(or --teacher fixture, for the tiny fixture's data)")


def run(args, log=print) -> int:
    """``nla-grpo data explain`` from its parsed arguments (``add_arguments``)."""
    return explain_command(args.splits_dir, teacher=args.teacher, base_url=args.base_url, model=args.model, api=args.api,
                           api_key_env=args.api_key_env, concurrency=args.concurrency, max_rows=args.max_rows,
                           timeout_s=args.timeout_s, retries=args.retries, max_tokens=args.max_tokens, log=log)


def explain_command(splits_dir, *, teacher: str | None = None, base_url: str | None = None, model: str | None = None,
                    api: str = "openai", api_key_env: str | None = None, concurrency: int = 8, max_rows: int | None = None,
                    timeout_s: float = 120.0, retries: int = 3, max_tokens: int = 256, log=print) -> int:
    """Explain the SFT splits in ``splits_dir`` with the teacher at ``base_url`` (or the tiny fixture's rule,
    ``teacher="fixture"``), then print the usage and what comes next; returns 0."""
    import contextlib

    teacher_arguments(teacher, base_url, model)
    with contextlib.ExitStack() as stack:
        if teacher == "fixture":
            from nla_grpo.dataprep.fixture_teacher import MODEL_NAME, FixtureTeacher

            base_url, model, api = stack.enter_context(FixtureTeacher()).url, MODEL_NAME, "openai"
            log(f"[explain] teacher: the tiny fixture's rule (the explanation is the marked token), on {base_url}")
        explain_splits(splits_dir, base_url=base_url, model=model, api=api, api_key_env=api_key_env,
                       concurrency=concurrency, max_rows=max_rows, timeout_s=timeout_s, retries=retries,
                       max_tokens=max_tokens, log=log)
    d = Path(splits_dir)
    log(f"next: nla-grpo sft av CONFIG.yaml and nla-grpo sft ar CONFIG.yaml with --set data.parquet={d / 'rl.parquet'} "
        f"(each stage reads its {d}/<stage>_sft{OUT_SUFFIX})")
    return 0

if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="nla-grpo data explain", description="teacher explanations for the SFT splits")
    add_arguments(_parser)
    try:
        sys.exit(run(_parser.parse_args(), log=lambda m: print(m, flush=True)))
    except NlaInputError as _exc:
        print(f"nla-grpo: error: {_exc}", file=sys.stderr)
        sys.exit(2)
