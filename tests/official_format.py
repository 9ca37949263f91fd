"""The official NLA release's dataset sidecar, restated as checks (from its documented format and its
pipeline's reader): what that reader requires of a `<parquet>.nla_meta.yaml` between its stages."""

DATASET_TOP_LEVEL_REQUIRED = {"kind": str, "schema_version": int, "dataset_id": str, "stage": str, "row_count": int,
                              "extraction": dict}
EXTRACTION_FIELDS = {"base_model": str, "d_model": int, "layer_index": int, "norm": str, "corpus": str,
                     "corpus_slice": dict, "positions_per_doc": int}
TOKEN_FIELDS = {"injection_char": str, "injection_token_id": int, "injection_left_neighbor_id": int,
                "injection_right_neighbor_id": int, "critic_suffix_ids": (list, type(None))}
STAGES = ("base", "av_sft", "ar_sft", "rl")


def official_dataset_problems(meta: dict) -> list[str]:
    """Why the official reader would refuse ``meta`` (empty: it reads it). Unknown top-level keys are
    dropped there; unknown or missing keys inside ``extraction`` and ``tokens`` are errors."""
    problems = []
    for key, kind in DATASET_TOP_LEVEL_REQUIRED.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            problems.append(f"{key}: expected {kind.__name__}, found {meta.get(key)!r}")
    if meta.get("kind") != "nla_dataset":
        problems.append("kind: expected nla_dataset")
    if meta.get("schema_version") != 1:
        problems.append("schema_version: expected 1")
    if meta.get("stage") not in STAGES:
        problems.append(f"stage: expected one of {STAGES}")
    for section, fields in (("extraction", EXTRACTION_FIELDS), ("tokens", TOKEN_FIELDS)):
        node = meta.get(section)
        if node is None and section == "tokens":
            continue
        node = node or {}
        for key in set(node) - set(fields):
            problems.append(f"{section}.{key}: unknown field")
        for key, kind in fields.items():
            if key not in node or not isinstance(node[key], kind):
                problems.append(f"{section}.{key}: missing or not {kind}")
    if meta.get("stage") in ("av_sft", "ar_sft", "rl"):
        if not meta.get("tokens") or not (meta.get("prompt_templates") or {}).get("actor"):
            problems.append("a training stage needs tokens and prompt_templates.actor")
    if (meta.get("extraction") or {}).get("norm") != "none":
        problems.append("extraction.norm: expected none")
    return problems
