"""`nla-grpo data extract` throughput: documents/s at 512-token documents on the Qwen3-8B shape.

The model is the random 8B-shape checkpoint ``step_benchmark.py`` builds (reused when its work
directory exists); the corpus is generated words, each document cut to ``--doc-tokens`` tokens. The
extraction runs the model cut after ``--layer`` (the default 24 keeps 25 of its 36 blocks), bf16.

    python benchmarks/extract_benchmark.py --out benchmarks/results/h200-extract.json
    python benchmarks/extract_benchmark.py --device cpu --docs 64 --out /tmp/extract-cpu.json   # checks the script
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_benchmark  # noqa: E402  (the 8B-shape model directory)


def corpus(path: Path, tokenizer, docs: int, doc_tokens: int, seed: int) -> Path:
    import numpy as np

    rng = np.random.default_rng(seed)
    words = "sea wave salt ship tide fish coral harbor tree leaf moss wolf pine street tower bus bread oven soup".split()
    with open(path, "w") as f:
        for i in range(docs):
            text = " ".join(rng.choice(words, doc_tokens))  # at least one token a word: cut to doc_tokens below
            ids = tokenizer(text)["input_ids"][:doc_tokens]
            f.write(json.dumps({"text": tokenizer.decode(ids), "doc_id": f"bench-{i}"}) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", default="/tmp/nla-bench")
    ap.add_argument("--layers", type=int, default=36, help="decoder blocks of the checkpoint")
    ap.add_argument("--layer", type=int, default=24, help="the block whose residual is extracted")
    ap.add_argument("--docs", type=int, default=2048)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/h200-extract.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from nla_grpo.dataprep.extract import extract

    shape = step_benchmark.QWEN3_8B
    if args.device == "cpu":
        step_benchmark.DEVICE, shape = "cpu", step_benchmark.SMALL
        args.layers, args.layer, args.docs, args.batch_size = 4, 2, min(args.docs, 64), 8
    root = step_benchmark.build_workdir(Path(args.workdir), shape, args.layers, 8, 200, seed=0)
    tok = AutoTokenizer.from_pretrained(root / "model")
    docs = corpus(root / "extract-corpus.jsonl", tok, args.docs, args.doc_tokens, seed=0)
    out = root / "extract-out"
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    written = extract(docs, root / "model", args.layer, out, positions_per_doc=10, min_position=50, splits="rl=1.0",
                      max_tokens=args.doc_tokens, batch_size=args.batch_size, device=args.device, workers=args.workers,
                      log=lambda m: print(m, flush=True))
    wall = time.perf_counter() - t
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(written["rl"]).metadata.num_rows
    res = {"config": vars(args), "wall_s": wall, "docs_per_s": args.docs / wall, "tokens_per_s": args.docs * args.doc_tokens / wall,
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{args.docs} documents of {args.doc_tokens} tokens, layer {args.layer}: {wall:.1f} s, "
          f"{res['docs_per_s']:.1f} docs/s, {res['tokens_per_s']:.0f} tokens/s, {rows} rows")
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
