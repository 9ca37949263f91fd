"""The judged evals: which prompts each one asks about, what it asks the judge, and how it counts.

Each eval is a small class over fixed items (chosen once, before any actor starts, document-disjoint
from training): ``judge_prompt(item, explanation)`` is what the judge reads, ``judge_value(verdict)``
takes its reply apart (None = a judge failure: an HTTP error, no JSON, or a reply of the wrong
shape), ``metrics(records)`` aggregates one eval step. A judge failure is never counted as a pass.

- ``hallucination``: the judge reads the source text behind the activation and the explanation and
  lists the explanation's claims the text does not support. ``hallucinations_mean`` (unsupported
  claims per judged explanation), ``clean_rate`` (share with none), ``judge_failures``, ``judged``,
  ``no_explanation`` (samples without an extractable explanation: not judged).
- ``karvonen_confusion``: records (JSONL, one per line: ``prompt`` as chat messages with one
  ``<INJECT>``, ``activation``, ``quirk``, ``distractor``, optional ``id``); the judge says whether the
  explanation names the quirk rather than the distractor. ``captures_quirk_rate`` over the samples the
  judge answered (a sample without an explanation captures nothing), ``judge_failures``.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nla_grpo.shared.errors import NlaInputError

SYSTEM = ("You check explanations that a language model wrote of one of its internal activations. Answer with one "
          "JSON object and nothing else.")


@dataclass
class EvalItem:
    key: str  # stable id of the item (a row id, a record id)
    prompt_ids: list[int]
    site: int
    vector: np.ndarray
    context: dict = field(default_factory=dict)  # what the judge is shown besides the explanation


class JudgedEval:
    """Fixed items; the judge's question about one, how its reply reads, how a step's records add up."""

    id: str
    value_key: str  # the record field holding ``judge_value`` of the reply

    def __init__(self, items: list[EvalItem]):
        self.items = items


class HallucinationEval(JudgedEval):
    id = "hallucination"
    value_key = "unsupported_claims"

    def judge_prompt(self, item: EvalItem, explanation: str) -> tuple[str, str]:
        return SYSTEM, (
            f"Source text the activation was read from:\n<<<\n{item.context['text']}\n>>>\n\n"
            f"Explanation:\n<<<\n{explanation}\n>>>\n\n"
            "List every claim the explanation makes that the source text does not support. Answer as "
            '{"unsupported_claims": ["...", "..."]}, with an empty list when the text supports every claim.')

    @staticmethod
    def judge_value(reply: dict | None):
        claims = (reply or {}).get("unsupported_claims")
        if not isinstance(claims, list) or not all(isinstance(c, str) for c in claims):
            return None
        return claims

    @staticmethod
    def metrics(records: list[dict]) -> dict:
        judged = [r["unsupported_claims"] for r in records if r.get("unsupported_claims") is not None]
        counts = [len(c) for c in judged]
        return {"hallucinations_mean": float(np.mean(counts)) if counts else float("nan"),
                "clean_rate": float(np.mean([c == 0 for c in counts])) if counts else float("nan"),
                "judge_failures": sum(1 for r in records if r.get("judge_error")),
                "judged": len(counts), "no_explanation": sum(1 for r in records if r["explanation"] is None)}


class KarvonenConfusionEval(JudgedEval):
    id = "karvonen_confusion"
    value_key = "captures_quirk"

    def judge_prompt(self, item: EvalItem, explanation: str) -> tuple[str, str]:
        quirk, distractor = item.context["quirk"], item.context["distractor"]
        # which property is shown first is fixed per item but not always the quirk
        first, second = (quirk, distractor) if zlib.crc32(item.key.encode()) % 2 == 0 else (distractor, quirk)
        return SYSTEM, (
            f"Explanation:\n<<<\n{explanation}\n>>>\n\n"
            f"Two properties a text can have:\n- {first}\n- {second}\n\n"
            f"Does the explanation describe this property: {quirk}? It does not if it only describes the other one "
            'or neither. Answer as {"captures_quirk": true} or {"captures_quirk": false}.')

    @staticmethod
    def judge_value(reply: dict | None):
        value = (reply or {}).get("captures_quirk")
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no"):
            return value.strip().lower() in ("true", "yes")
        return value if isinstance(value, bool) else None

    @staticmethod
    def metrics(records: list[dict]) -> dict:
        answered = [bool(r["captures_quirk"]) for r in records if r.get("captures_quirk") is not None]
        answered += [False for r in records if r["explanation"] is None]  # nothing said names nothing
        return {"captures_quirk_rate": float(np.mean(answered)) if answered else float("nan"),
                "judge_failures": sum(1 for r in records if r.get("judge_error")),
                "judged": sum(1 for r in records if r.get("captures_quirk") is not None)}


# ---- the items, chosen once before any actor starts ----------------------------------------------
def source_texts(parquet: str, column: str, row_ids) -> list[str]:
    """The ``column`` strings of ``row_ids``; one line naming the parquet and the column when absent."""
    from nla_grpo.shared.data import read_text_column

    return read_text_column(parquet, column, row_ids, f"evals.hallucination needs column '{column}' (the source text "
                            "behind each activation; evals.hallucination.text_column names another), found columns {names}",
                            "the source text")


def read_confusion_records(path: str, d_model: int) -> list[dict]:
    """The karvonen-confusion records, every line checked (one line naming the file, line and field)."""
    from nla_grpo.shared.prompts import INJECT_PLACEHOLDER

    p = Path(path)
    if not p.is_file():
        raise NlaInputError(p, "evals.karvonen_confusion.records: file not found")
    from nla_grpo.shared.fileio import iter_jsonl

    out = []
    for n, rec in iter_jsonl(p):
        for key in ("quirk", "distractor"):
            if not isinstance(rec.get(key), str) or not rec[key].strip():
                raise NlaInputError(p, f"line {n}, field '{key}': expected a non-empty string, found {rec.get(key)!r}")
        msgs = rec.get("prompt")
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                         and isinstance(m.get("role"), str) for m in msgs)):
            raise NlaInputError(p, f"line {n}, field 'prompt': expected chat messages (role, content), found {type(msgs).__name__}")
        if sum(m["content"].count(INJECT_PLACEHOLDER) for m in msgs) != 1:
            raise NlaInputError(p, f"line {n}, field 'prompt': expected exactly one {INJECT_PLACEHOLDER}")
        vec = rec.get("activation")
        if not (isinstance(vec, list) and len(vec) == d_model and all(isinstance(x, (int, float)) and np.isfinite(x) for x in vec)):
            found = f"{len(vec)} values" if isinstance(vec, list) else type(vec).__name__
            raise NlaInputError(p, f"line {n}, field 'activation': expected {d_model} finite numbers, found {found}")
        out.append({**rec, "id": str(rec.get("id", f"line-{n}"))})
    if not out:
        raise NlaInputError(p, "no records")
    return out


def build_evals(cfg, spec, tokenizer, eval_rows, prompt_ids, prompt_index_eval) -> list:
    """The enabled evals with their items (the hallucination eval's first rows of the eval split: the
    same every eval step)."""
    from nla_grpo.shared.prompts import find_marker_site, render_av_ids

    evals = []
    ec = cfg.evals
    if ec.hallucination.enabled:
        n = min(ec.hallucination.prompts, len(eval_rows))
        if n == 0:
            raise NlaInputError(cfg.data.parquet, "evals.hallucination: no eval rows to judge")
        texts = source_texts(cfg.data.parquet, ec.hallucination.text_column, eval_rows.row_ids[:n])
        items = []
        for i in range(n):
            ids, site = prompt_ids[int(prompt_index_eval[i])]
            items.append(EvalItem(f"row-{int(eval_rows.row_ids[i])}", list(ids), site, eval_rows.activations[i].copy(),
                                  {"text": texts[i], "row_id": int(eval_rows.row_ids[i]), "doc_id": eval_rows.doc_ids[i]}))
        evals.append(HallucinationEval(items))
    if ec.karvonen_confusion.enabled:
        records = read_confusion_records(ec.karvonen_confusion.records, spec.d_model)
        records = records[: ec.karvonen_confusion.prompts or len(records)]
        items = []
        for n, rec in enumerate(records):
            ids = render_av_ids(tokenizer, rec["prompt"], spec.marker, cfg.rollout.prefill, cfg.prompts.enable_thinking)
            try:
                site = find_marker_site(ids, spec.marker_id, spec.left_id, spec.right_id)
            except ValueError as exc:
                raise NlaInputError(ec.karvonen_confusion.records, f"record {rec['id']}: {exc}") from None
            items.append(EvalItem(rec["id"], ids, site, np.asarray(rec["activation"], dtype=np.float32),
                                  {"quirk": rec["quirk"], "distractor": rec["distractor"]}))
        evals.append(KarvonenConfusionEval(items))
    return evals


# ---- one eval step ---------------------------------------------------------------------------------
def run_evals(evals: list, judge, explanations_for, step: int) -> tuple[dict, list[dict]]:
    """Every eval at one step: ``explanations_for(eval)`` gives one explanation (or None) per item, from
    the current adapter; the judge reads each explanation there is. Returns ``eval/<id>/<metric>``
    metrics and one record per item."""
    metrics, records = {}, []
    for ev in evals:
        explanations = explanations_for(ev)
        asked = [j for j, e in enumerate(explanations) if e is not None]
        verdicts = dict(zip(asked, judge.ask_many([ev.judge_prompt(ev.items[j], explanations[j]) for j in asked])))
        recs = []
        for j, (item, expl) in enumerate(zip(ev.items, explanations)):
            v = verdicts.get(j)
            value = ev.judge_value(v.reply) if v is not None else None
            error = None if v is None else (v.error or (None if value is not None else "the reply has the wrong shape"))
            shown = {k: c for k, c in item.context.items() if k != "text"}
            recs.append({"step": step, "eval": ev.id, "item": item.key, **shown, "explanation": expl,
                         ev.value_key: value, "judge_error": error, "judge_reply": v.raw if v is not None else None})
        metrics.update({f"eval/{ev.id}/{k}": x for k, x in ev.metrics(recs).items()})
        records += recs
    return metrics, records
