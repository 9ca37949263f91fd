"""The RL parquet: streamed by row group (needed columns only, early stop), validated row by row.

Columns: ``prompt`` (chat messages with one ``<INJECT>``), ``activation_vector`` (fixed- or
variable-size list of floats, length d), ``doc_id``; others are ignored. Eval rows are the documents
whose doc_id hash falls under ``eval_fraction`` (document-disjoint from training), or, as the reference
trainer splits (``split_reference``), the rows past ``eval_skip_rows`` whose document none of the rows
before it has. ``ShuffledOrder`` gives a seeded, resumable batch order whose whole state is a small
dict; ``ReferenceOrder`` is the reference trainer's (what an imported run continues).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.prompts import INJECT_PLACEHOLDER

REQUIRED_COLUMNS = ("prompt", "activation_vector", "doc_id")
CHAT_ROLES = ("system", "user", "assistant")


@dataclass
class RlRows:
    """Rows of the RL parquet held in memory (activations as one float32 matrix)."""

    prompts: list[list[dict]]
    activations: np.ndarray
    doc_ids: list[str]
    row_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, idx) -> "RlRows":
        idx = np.asarray(idx, dtype=np.int64)
        return RlRows([self.prompts[i] for i in idx], self.activations[idx], [self.doc_ids[i] for i in idx], self.row_ids[idx])


def open_parquet(path: str | Path):
    """A ``pyarrow.parquet.ParquetFile`` with the required columns, or a one-line error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise NlaInputError(p, "parquet file not found")
    try:
        # pages written with a CRC (ours are) are checked as they are read; others cannot be
        pf = pq.ParquetFile(p, page_checksum_verification=True)
    except (pa.ArrowInvalid, OSError) as exc:
        raise NlaInputError(p, f"not a parquet file ({str(exc).splitlines()[0][:80]})") from None
    names = pf.schema_arrow.names
    for col in REQUIRED_COLUMNS:
        if col not in names:
            raise NlaInputError(p, f"column {col!r} missing (found {names})")
    return pf


def _activation_matrix(col, d: int, where: Path, first_row: int) -> np.ndarray:
    import pyarrow as pa

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise NlaInputError(where, f"column 'activation_vector': expected a list of floats, found {t}")
    if not pa.types.is_floating(t.value_type):
        raise NlaInputError(where, f"column 'activation_vector': expected float values, found {t.value_type}")
    if col.null_count:
        bad = first_row + int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise NlaInputError(where, f"row {bad}, column 'activation_vector': null vector")
    if pa.types.is_fixed_size_list(t):
        if t.list_size != d:
            raise NlaInputError(where, f"row {first_row}, column 'activation_vector': expected length {d} (sidecar d_model), found {t.list_size}")
        flat = col.flatten()
    else:
        lengths = np.diff(col.offsets.to_numpy())
        wrong = np.flatnonzero(lengths != d)
        if wrong.size:
            r = int(wrong[0])
            raise NlaInputError(where, f"row {first_row + r}, column 'activation_vector': expected length {d} (sidecar d_model), found {int(lengths[r])}")
        flat = col.flatten()
    mat = flat.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, d)
    finite = np.isfinite(mat).all(axis=1)
    if not finite.all():
        r = int(np.flatnonzero(~finite)[0])
        raise NlaInputError(where, f"row {first_row + r}, column 'activation_vector': non-finite value (NaN or inf)")
    return mat


def _check_prompt(prompt, where: Path, row: int) -> list[dict]:
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "content" in m for m in prompt):
        raise NlaInputError(where, f"row {row}, column 'prompt': expected a list of chat messages with 'role' and 'content'")
    for j, m in enumerate(prompt):
        if m.get("role") not in CHAT_ROLES or not isinstance(m["content"], str):
            raise NlaInputError(where, f"row {row}, column 'prompt', message {j}: expected 'role' one of {', '.join(CHAT_ROLES)} "
                                       f"and 'content' text, found role {m.get('role')!r}")
    n = sum(m["content"].count(INJECT_PLACEHOLDER) for m in prompt if isinstance(m.get("content"), str))
    if n != 1:
        raise NlaInputError(where, f"row {row}, column 'prompt': expected exactly one {INJECT_PLACEHOLDER}, found {n}")
    return [{"role": m.get("role"), "content": m["content"]} for m in prompt]


def _read_row_group(pf, rg: int, where: Path, first_row: int):
    """One row group's required columns; a damaged one (footer intact, a page that fails its CRC or
    does not decode) is a one-line error naming it and its rows."""
    import pyarrow as pa

    try:
        return pf.read_row_group(rg, columns=list(REQUIRED_COLUMNS))
    except (pa.ArrowException, OSError) as exc:
        last = first_row + pf.metadata.row_group(rg).num_rows - 1
        raise NlaInputError(where, f"row group {rg} of {pf.num_row_groups} (rows {first_row}-{last}) is damaged "
                                   f"({(str(exc).splitlines() or [type(exc).__name__])[0][:100]})") from None


def read_rows(path: str | Path, d_model: int, max_rows: int | None = None, progress=None) -> RlRows:
    """Stream the parquet row group by row group and stop after ``max_rows``; every row validated."""
    p = Path(path)
    pf = open_parquet(p)
    prompts: list[list[dict]] = []
    acts: list[np.ndarray] = []
    docs: list[str] = []
    seen = 0
    for rg in range(pf.num_row_groups):
        if max_rows is not None and seen >= max_rows:
            break
        table = _read_row_group(pf, rg, p, seen)
        if max_rows is not None:
            table = table.slice(0, max_rows - seen)
        acts.append(_activation_matrix(table.column("activation_vector"), d_model, p, seen))
        for i, pr in enumerate(table.column("prompt").to_pylist()):
            prompts.append(_check_prompt(pr, p, seen + i))
        for i, doc in enumerate(table.column("doc_id").to_pylist()):
            if doc is None:
                raise NlaInputError(p, f"row {seen + i}, column 'doc_id': null")
            docs.append(str(doc))
        seen += table.num_rows
        if progress is not None:
            progress(seen, pf.metadata.num_rows if max_rows is None else min(max_rows, pf.metadata.num_rows))
    if seen == 0:
        raise NlaInputError(p, "no rows")
    mat = np.concatenate(acts, axis=0) if acts else np.zeros((0, d_model), np.float32)
    return RlRows(prompts, mat, docs, np.arange(seen, dtype=np.int64))


def read_text_column(path: str | Path, column: str, row_ids, missing: str, expected: str = "a non-empty string") -> list[str]:
    """The ``column`` strings of ``row_ids`` in the parquet at ``path``, each checked non-empty; one line naming
    the file when the column is absent (``missing`` says why it is needed) or a row holds no text."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if column not in names:
        raise NlaInputError(path, missing.format(names=names))
    values = pf.read(columns=[column]).column(column).to_pylist()
    out = []
    for r in row_ids:
        text = values[int(r)]
        if not isinstance(text, str) or not text.strip():
            raise NlaInputError(path, f"row {int(r)}, column '{column}': expected {expected}, found {text!r}")
        out.append(text)
    return out


def is_eval_doc(doc_id: str, fraction: float) -> bool:
    """Stable document-level split: sha256(doc_id) as a number in [0, 1) below ``fraction``."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < fraction


def split_eval(rows: RlRows, fraction: float) -> tuple[RlRows, RlRows]:
    """(train, eval), document-disjoint."""
    mask = np.array([is_eval_doc(d, fraction) for d in rows.doc_ids], dtype=bool)
    return rows.subset(np.flatnonzero(~mask)), rows.subset(np.flatnonzero(mask))


def split_reference(rows: RlRows, max_rows: int, eval_skip_rows: int) -> tuple[RlRows, RlRows]:
    """(train, eval) as the reference trainer takes them: training on the first ``max_rows`` rows,
    evaluating on the rows past ``eval_skip_rows`` whose document is not among the first ``eval_skip_rows``
    rows' (a row-shuffled file shares documents across any cut), in file order."""
    n = len(rows)
    seen = set(rows.doc_ids[: min(eval_skip_rows, n)])
    ev = [i for i in range(eval_skip_rows, n) if rows.doc_ids[i] not in seen]
    return rows.subset(np.arange(min(max_rows, n))), rows.subset(np.asarray(ev, dtype=np.int64))


@dataclass
class ShuffledOrder:
    """Seeded epoch permutations of ``n`` rows; ``state()`` / ``from_state`` resume exactly."""

    n: int
    seed: int
    epoch: int = 0
    cursor: int = 0
    _perm: np.ndarray | None = field(default=None, repr=False)

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        return self._perm

    def next_batch(self, k: int) -> list[int]:
        """The next ``k`` row indices; a new epoch (new permutation) when fewer than ``k`` remain."""
        if k > self.n:
            raise ValueError(f"batch of {k} prompts from only {self.n} rows")
        if self.cursor + k > self.n:
            self.epoch, self.cursor, self._perm = self.epoch + 1, 0, None
        out = self._permutation()[self.cursor : self.cursor + k].tolist()
        self.cursor += k
        return out

    def state(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "cursor": self.cursor}

    @classmethod
    def from_state(cls, state: dict) -> "ShuffledOrder":
        return cls(n=int(state["n"]), seed=int(state["seed"]), epoch=int(state["epoch"]), cursor=int(state["cursor"]))


class ReferenceOrder:
    """The reference trainer's batch order: one ``numpy.random.default_rng(seed)`` shuffles the list of
    row indices in place at the start and again whenever fewer than a batch remain; batches are read
    at a cursor. Its state (the list, the cursor and the generator's state) is what the reference
    trainer's ``training_state.pt`` holds, so an imported run continues its order exactly."""

    kind = "reference"

    def __init__(self, n: int, seed: int, pending: list[int] | None = None, cursor: int = 0, rng_state: dict | None = None):
        self.n, self.seed = n, seed
        self.rng = np.random.default_rng(seed)
        if pending is None:
            pending = list(range(n))
            self.rng.shuffle(pending)
        elif rng_state is not None:
            self.rng.bit_generator.state = rng_state
        if sorted(pending) != list(range(n)):
            raise ValueError(f"the row order is not a permutation of the {n} training rows ({len(pending)} entries)")
        if not 0 <= int(cursor) <= n:
            raise ValueError(f"cursor: expected 0..{n}, found {cursor}")
        self.pending, self.cursor = [int(i) for i in pending], int(cursor)

    def next_batch(self, k: int) -> list[int]:
        if k > self.n:
            raise ValueError(f"batch of {k} prompts from only {self.n} rows")
        if self.cursor + k > self.n:
            self.rng.shuffle(self.pending)
            self.cursor = 0
        out = self.pending[self.cursor : self.cursor + k]
        self.cursor += k
        return list(out)

    def state(self) -> dict:
        return {"kind": self.kind, "n": self.n, "seed": self.seed, "cursor": self.cursor, "pending": list(self.pending),
                "rng_state": _json_rng_state(self.rng.bit_generator.state)}

    @classmethod
    def from_state(cls, state: dict) -> "ReferenceOrder":
        return cls(int(state["n"]), int(state["seed"]), list(state["pending"]), int(state["cursor"]), state["rng_state"])


def _json_rng_state(state: dict) -> dict:
    # PCG64's state holds 128-bit integers: JSON keeps them exactly (Python reads them back as ints)
    return {k: _json_rng_state(v) if isinstance(v, dict) else (int(v) if isinstance(v, (int, np.integer)) else v)
            for k, v in state.items()}


def make_order(kind: str, n: int, seed: int):
    """A fresh batch order of ``data.order`` kind."""
    return ReferenceOrder(n, seed) if kind == "reference" else ShuffledOrder(n, seed)


def order_from_state(state: dict):
    """The order a checkpoint saved (older checkpoints hold a ``ShuffledOrder`` without a kind)."""
    return ReferenceOrder.from_state(state) if state.get("kind") == "reference" else ShuffledOrder.from_state(state)
