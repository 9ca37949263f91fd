"""AV and critic prompts: render with the marker, tokenize, and find the single injection site.

Rendering is the one place that calls ``apply_chat_template``; every service goes through it so the
token ids seen by rollout, learner and data check are the same. ``enable_thinking`` (the config's
``prompts.enable_thinking``) is handed to the template only when set: unset is how the reference
trainer renders (on Qwen3 templates ``false`` adds an empty think block to the generation prompt).
"""
from __future__ import annotations

INJECT_PLACEHOLDER = "<INJECT>"


def as_ids(out) -> list[int]:
    """Token ids as a flat list, whatever ``encode`` / ``apply_chat_template`` returned."""
    # transformers 5 may return a BatchEncoding from apply_chat_template(tokenize=True)
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def substitute_marker(messages: list[dict], marker: str) -> list[dict]:
    """Replace ``<INJECT>`` by the marker character in every string message content."""
    return [
        {**m, "content": m["content"].replace(INJECT_PLACEHOLDER, marker)} if isinstance(m.get("content"), str) else dict(m)
        for m in messages
    ]


def render_av_text(tokenizer, messages: list[dict], marker: str, prefill: str = "", enable_thinking: bool | None = None) -> str:
    """The AV prompt as text: chat template with generation prompt, then the assistant prefill."""
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template(substitute_marker(messages, marker), tokenize=False, add_generation_prompt=True, **extra)
    return text + prefill


def render_av_ids(tokenizer, messages: list[dict], marker: str, prefill: str = "", enable_thinking: bool | None = None) -> list[int]:
    """Token ids of the AV prompt (never re-tokenized elsewhere)."""
    text = render_av_text(tokenizer, messages, marker, prefill, enable_thinking)
    return as_ids(tokenizer.encode(text, add_special_tokens=False))


def marker_sites(ids, marker_id: int, left_id: int, right_id: int) -> list[int]:
    """Positions holding the marker with both neighbours in place, never at an edge."""
    ids = list(ids)
    return [
        p for p in range(1, len(ids) - 1)
        if ids[p] == marker_id and ids[p - 1] == left_id and ids[p + 1] == right_id
    ]


def find_marker_site(ids, marker_id: int, left_id: int, right_id: int) -> int:
    """The single valid marker position; ValueError naming what was found otherwise."""
    ids = list(ids)
    sites = marker_sites(ids, marker_id, left_id, right_id)
    occurrences = sum(1 for t in ids if t == marker_id)
    if len(sites) != 1 or occurrences != 1:
        raise ValueError(
            f"expected exactly one marker id {marker_id} between ids {left_id} and {right_id}, "
            f"found {occurrences} occurrence(s) and {len(sites)} valid site(s)"
        )
    return sites[0]


def has_marker_trigram(ids, marker_id: int, left_id: int, right_id: int) -> bool:
    """True when ``ids`` re-create the left-marker-right trigram (a response that would add a site)."""
    ids = list(ids)
    return any(
        ids[p] == marker_id and ids[p - 1] == left_id and ids[p + 1] == right_id for p in range(1, len(ids) - 1)
    )


def render_critic_text(template: str, explanation: str) -> str:
    """The critic (AR) prompt for one explanation."""
    return template.format(explanation=explanation)


def start_token(tokenizer) -> int | None:
    """The start token the tokenizer puts before a text of its own accord (Gemma's ``<bos>``, Llama 3's
    ``<|begin_of_text|>``), or None (Qwen has none). The AV prompt gets it from the chat template's text."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    return int(bos) if as_ids(tokenizer.encode("a", add_special_tokens=True))[:1] == [int(bos)] else None


def render_critic_ids(tokenizer, template: str, explanation: str, bos: int | None = None) -> list[int]:
    """The critic prompt's ids, after ``bos`` when one is given (a model trained with its start token
    reads a prompt without it much worse: on Gemma the official release saw FVE fall from 0.77 to 0.31)."""
    ids = as_ids(tokenizer.encode(render_critic_text(template, explanation), add_special_tokens=False))
    return [bos] + ids if bos is not None and ids[:1] != [bos] else ids


def prompt_table(row_sets, tokenizer, spec, prefill: str, source, enable_thinking: bool | None = None) -> tuple[list[tuple[list[int], int]], list]:
    """Render each distinct prompt of ``row_sets`` (``RlRows``) once: ``(table, indices)``.

    ``table[k] = (ids, marker site)``; ``indices[j][i]`` is the table entry of row ``i`` of
    ``row_sets[j]``. A prompt whose marker is not one valid site stops with a line naming ``source``
    and the row. Training and ``data check`` both call this, so they render and refuse alike.
    """
    import json

    import numpy as np

    from nla_grpo.shared.errors import NlaInputError

    seen: dict[str, int] = {}
    table: list[tuple[list[int], int]] = []
    indices = []
    for rows in row_sets:
        out = np.zeros(len(rows), dtype=np.int64)
        for i, prompt in enumerate(rows.prompts):
            key = json.dumps(prompt, sort_keys=True)
            if key not in seen:
                ids = render_av_ids(tokenizer, prompt, spec.marker, prefill, enable_thinking)
                try:
                    site = find_marker_site(ids, spec.marker_id, spec.left_id, spec.right_id)
                except ValueError as exc:
                    raise NlaInputError(source, f"row {int(rows.row_ids[i])}, column 'prompt': {exc}") from None
                seen[key] = len(table)
                table.append((ids, site))
            out[i] = seen[key]
        indices.append(out)
    return table, indices
