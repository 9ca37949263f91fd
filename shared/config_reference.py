"""The run configuration's reference page, written from the schema itself (``shared.config``): every field with its
type, default and documentation, section by section. ``docs/configuration.md`` is this page; a test keeps the two
equal, so the reference never drifts from what the code accepts.

    python -m nla_grpo.shared.config_reference > docs/configuration.md
"""
from __future__ import annotations

import inspect
import re
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = """# Configuration reference

Every field of a run config (`nla-grpo train CONFIG.yaml`, the `config:` of a pipeline file), section by section,
with its type, its default and what it does. Written from the schema (`shared/config.py`) by
`python -m nla_grpo.shared.config_reference`; a test keeps it equal to the code.

`auto` becomes a value in one module, `shared/resolve.py`: with the config (`rollout.lora`, `weight_sync.kind`, and
`rollout.sleep_during_update` where the batch decides it), and once the model and data are read
(`rollout.vector_input`, `rollout.max_prompt_tokens`, `logging.eval_at_start`, the critic's LoRA from its checkpoint).
A run directory's `config.yaml` is the config after both, and `nla-grpo config check CONFIG --show` prints the same.
What stays `auto` there is a policy applied as the run goes: `learner.micro_batch` (each update sized from the memory
free then), `rollout.gpu_memory_utilization` and `rollout.max_num_seqs` (the memory plan, per card), the learner's
`optimizer`, `kernels` and `attention`, `model.dtype` (per device), and `rollout.sleep_during_update` where the batch
does not decide it (decided at the start from the learner's awake micro-batch, and logged).
"""


def _type_name(annotation) -> str:
    """A field's type as a reader writes it: ``int``, ``auto | float``, ``list[str]``, ``adapter | merged`` (the bars
    escaped for a table cell)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names) + (" \\| null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    if origin is dict:
        return "mapping"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)).replace("NoneType", "null")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    else:
        value = field.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if value not in ("", [], {}) else f"`{value!r}`"


def _text(description: str | None) -> str:
    """The field's documentation on one table row."""
    return re.sub(r"\s+", " ", (description or "").strip()).replace("|", "\\|")


def _section(name: str, model: type[BaseModel], doc: str | None) -> list[str]:
    lines = [f"## `{name}`", ""]
    if doc:
        lines += [_text(doc), ""]
    rows, nested = [], []
    for key, field in model.model_fields.items():
        annotation = field.annotation
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            nested.append((f"{name}.{key}", annotation, field.description))
            continue
        rows.append(f"| `{key}` | {_type_name(annotation)} | {_default(field)} | {_text(field.description)} |")
    if rows:
        lines += ["| field | type | default | what it does |", "|---|---|---|---|", *rows, ""]
    for sub in nested:
        lines += _section(*sub)
    return lines


def reference() -> str:
    """The whole page."""
    from nla_grpo.shared import config

    out = [HEADER]
    top = [f"| `{k}` | {_type_name(f.annotation)} | {_default(f)} | {_text(f.description)} |"
           for k, f in config.RunConfig.model_fields.items()
           if not (inspect.isclass(f.annotation) and issubclass(f.annotation, BaseModel)) and k != "weight_sync"]
    out += ["## Top level", "", "| field | type | default | what it does |", "|---|---|---|---|", *top, ""]
    for key, field in config.RunConfig.model_fields.items():
        annotation = field.annotation
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            out += _section(key, annotation, field.description)
    sync = config.RunConfig.model_fields["weight_sync"]
    out += ["## `weight_sync`", "", _text(sync.description), ""]
    for variant in typing.get_args(sync.annotation):
        kind = variant.model_fields["kind"].default
        out += [f"### kind `{kind}`", ""]
        if variant.__doc__:
            out += [_text(variant.__doc__), ""]
        rows = [f"| `{k}` | {_type_name(f.annotation)} | {_default(f)} | {_text(f.description)} |"
                for k, f in variant.model_fields.items() if k != "kind"]
        if rows:
            out += ["| field | type | default | what it does |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(reference())
