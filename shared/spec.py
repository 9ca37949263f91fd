"""The NLA spec: the official sidecar ``<parquet>.nla_meta.yaml``, validated against the live tokenizer.

The official release's dataset sidecar (``kind: nla_dataset``, ``schema_version: 1``) is read as it is
written: ``extraction.{base_model, d_model, layer_index}``, ``tokens.{injection_char,
injection_token_id, injection_left_neighbor_id, injection_right_neighbor_id, critic_suffix_ids}``,
``prompt_templates.{actor, critic}`` (``av`` / ``ar``, the names its released checkpoints use, too).
The AV template holds ``{injection_char}``; the AR template holds ``{explanation}``.

The scales: the official pipeline passes the injection scale to its trainer on the command line, so
its dataset sidecars carry none; here it comes from the config (``injection.scale``) or from an
``injection_scale`` key of the sidecar (top level, which the official readers ignore, or under
``extraction`` as older sidecars of this project have it). A run in ``embed`` mode with neither is
refused; nothing silently means "raw". ``mse_scale`` defaults to ``sqrt_d_model``, as there.
Older sidecars of this project (``schema_version: 2``, ``base_model`` at the top level) still read.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.prompts import as_ids, find_marker_site, render_av_ids
from nla_grpo.shared.schema import resolve_scale

SIDECAR_SUFFIX = ".nla_meta.yaml"
DATASET_KIND = "nla_dataset"
SCHEMA_VERSIONS = (1, 2)  # 1: the official release's; 2: this project's older tiny sidecars
SCALE_CHOICES = "a positive number, 'sqrt_d_model', 'embed_norm' or 'raw'"


def sidecar_path(parquet: str | Path) -> Path:
    p = Path(parquet)
    return p.with_name(p.name + SIDECAR_SUFFIX)


@dataclass(frozen=True)
class NlaSpec:
    """What the data says about the subject model, the marker and the prompts."""

    path: Path
    base_model: str
    d_model: int
    layer_index: int
    injection_scale_raw: object
    mse_scale_raw: object
    marker: str
    marker_id: int
    left_id: int
    right_id: int
    av_template: str
    ar_template: str

    @property
    def mse_scale(self) -> float | None:
        return resolve_scale(self.mse_scale_raw, self.d_model)

    def require_injection_scale(self, override=None) -> None:
        """One line when neither the config (``override``) nor the sidecar gives the injection scale."""
        if override is None and self.injection_scale_raw is None:
            raise NlaInputError(self.path, f"injection_scale: missing (the official pipeline leaves it to the trainer); "
                                           f"set injection.scale in the config: {SCALE_CHOICES}")

    def injection_scale(self, override=None, embed_norm: float | None = None) -> float | None:
        """Target norm of the injected vector; ``embed_norm`` resolves the 'embed_norm' keyword."""
        self.require_injection_scale(override)
        raw = self.injection_scale_raw if override is None else override
        if isinstance(raw, str) and raw.strip().lower() == "embed_norm":
            if embed_norm is None:
                raise ValueError("injection scale 'embed_norm' needs the embedding matrix")
            return float(embed_norm)
        return resolve_scale(raw, self.d_model)

    def resolve_base_model(self) -> Path | None:
        """``base_model`` as a local directory (absolute, or relative to the sidecar), if it is one."""
        for cand in (Path(self.base_model), self.path.parent / self.base_model):
            if cand.is_dir():
                return cand
        return None


def _need(node: dict, key: str, kind, where: Path, section: str):
    if not isinstance(node, dict) or key not in node or node[key] is None:
        raise NlaInputError(where, f"{section}{key}: missing")
    val = node[key]
    if kind is int and (not isinstance(val, int) or isinstance(val, bool)):
        raise NlaInputError(where, f"{section}{key}: expected an integer, found {val!r}")
    if kind is str and not isinstance(val, str):
        raise NlaInputError(where, f"{section}{key}: expected a string, found {val!r}")
    return val


def load_spec(path: str | Path) -> NlaSpec:
    """Read a sidecar file; structural errors name the file and the field."""
    p = Path(path)
    if not p.is_file():
        raise NlaInputError(p, "sidecar not found (expected <parquet>.nla_meta.yaml beside the parquet)")
    try:
        meta = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        raise NlaInputError(p, "sidecar is not valid YAML") from None
    if not isinstance(meta, dict):
        raise NlaInputError(p, "expected a mapping at the top level")
    if meta.get("kind", DATASET_KIND) != DATASET_KIND:
        raise NlaInputError(p, f"kind: expected {DATASET_KIND} (a dataset sidecar), found {meta.get('kind')!r}")
    if meta.get("schema_version", 1) not in SCHEMA_VERSIONS:
        raise NlaInputError(p, f"schema_version: expected one of {list(SCHEMA_VERSIONS)}, found {meta.get('schema_version')!r}")
    ext = meta.get("extraction") or {}
    tok = meta.get("tokens") or {}
    tpl = meta.get("prompt_templates") or {}
    tpl = {"av": tpl.get("av") or tpl.get("actor"), "ar": tpl.get("ar") or tpl.get("critic")}
    spec = NlaSpec(
        path=p,
        base_model=str(ext.get("base_model") or meta.get("base_model") or ""),
        d_model=_need(ext, "d_model", int, p, "extraction."),
        layer_index=_need(ext, "layer_index", int, p, "extraction."),
        injection_scale_raw=meta.get("injection_scale", ext.get("injection_scale")),
        mse_scale_raw=meta.get("mse_scale", ext.get("mse_scale", "sqrt_d_model")),
        marker=_need(tok, "injection_char", str, p, "tokens."),
        marker_id=_need(tok, "injection_token_id", int, p, "tokens."),
        left_id=_need(tok, "injection_left_neighbor_id", int, p, "tokens."),
        right_id=_need(tok, "injection_right_neighbor_id", int, p, "tokens."),
        av_template=_need(tpl, "av", str, p, "prompt_templates."),
        ar_template=_need(tpl, "ar", str, p, "prompt_templates."),
    )
    if spec.d_model < 1 or spec.layer_index < 0:
        raise NlaInputError(p, f"extraction: expected d_model >= 1 and layer_index >= 0, found {spec.d_model}, {spec.layer_index}")
    for field, raw in (("injection_scale", spec.injection_scale_raw), ("mse_scale", spec.mse_scale_raw)):
        if raw is None or (isinstance(raw, str) and raw.strip().lower() == "embed_norm"):
            continue
        try:
            resolve_scale(raw, spec.d_model)
        except (TypeError, ValueError):
            raise NlaInputError(p, f"extraction.{field}: expected a number, 'sqrt_d_model' or 'raw', found {raw!r}") from None
    if "{injection_char}" not in spec.av_template:
        raise NlaInputError(p, "prompt_templates.av: expected a '{injection_char}' placeholder")
    if "{explanation}" not in spec.ar_template:
        raise NlaInputError(p, "prompt_templates.ar: expected an '{explanation}' placeholder")
    return spec


def validate_against_tokenizer(spec: NlaSpec, tokenizer) -> None:
    """The marker encodes to exactly its id, appears once in the rendered AV prompt, neighbours match."""
    where = spec.path
    ids = as_ids(tokenizer.encode(spec.marker, add_special_tokens=False))
    if ids != [spec.marker_id]:
        raise NlaInputError(
            where, f"tokens.injection_char {spec.marker!r}: expected to encode to the single id {spec.marker_id}, found {ids}"
        )
    canonical = [{"role": "user", "content": spec.av_template.format(injection_char="<INJECT>")}]
    rendered = render_av_ids(tokenizer, canonical, spec.marker)
    hits = [i for i, t in enumerate(rendered) if t == spec.marker_id]
    if len(hits) != 1:
        raise NlaInputError(where, f"prompt_templates.av: expected the marker once in the rendered prompt, found {len(hits)}")
    p = hits[0]
    if p == 0 or p == len(rendered) - 1:
        raise NlaInputError(where, "prompt_templates.av: the marker sits at an edge of the rendered prompt")
    found = (rendered[p - 1], rendered[p + 1])
    if found != (spec.left_id, spec.right_id):
        raise NlaInputError(
            where,
            f"tokens.injection_left/right_neighbor_id: expected ({spec.left_id}, {spec.right_id}) around the marker, found {found}",
        )
    find_marker_site(rendered, spec.marker_id, spec.left_id, spec.right_id)
