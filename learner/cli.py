"""The ``nla-grpo`` command. Heavy libraries are imported inside each subcommand so --help is instant."""
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nla-grpo", description="Train natural language autoencoders with GRPO on Ray + vLLM.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="run (or resume) a GRPO job")
    t.add_argument("config", nargs="?", help="run config YAML (see deploy/)")
    t.add_argument("--run-dir", help="run directory (default runs/<config name>-<time>)")
    t.add_argument("--steps", type=int, help="total step count to reach")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. grpo.steps=10")

    d = sub.add_parser("data", help="datasets: build the tiny fixture, check a parquet")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    dt = dsub.add_parser("tiny", help="write a tiny Qwen3, tokenizer, RL parquet and sidecar")
    dt.add_argument("out_dir")
    dt.add_argument("--seed", type=int, default=0)
    dc = dsub.add_parser("check", help="validate an RL parquet against its sidecar and tokenizer")
    dc.add_argument("parquet")
    dc.add_argument("--sidecar", help="sidecar YAML (default <parquet>.nla_meta.yaml)")
    dc.add_argument("--model", help="model/tokenizer directory (default: the sidecar's base_model when local)")
    dc.add_argument("--eval-fraction", type=float, default=0.1)

    pl = sub.add_parser("plot", help="write PNG curves of a run's metrics")
    pl.add_argument("run_dir")
    return p


def _data_tiny(args) -> int:
    from pathlib import Path

    from shared.errors import NlaInputError

    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NlaInputError(out, "exists and is not an empty directory")
    from shared.tiny import build_tiny

    build_tiny(out, seed=args.seed)
    print(f"wrote {out}/model, {out}/rl.parquet and its sidecar (seed {args.seed})")
    return 0


def _train(args) -> int:
    from shared.config import load_config
    from shared.errors import NlaInputError

    if args.resume is None and args.config is None:
        raise NlaInputError("train", "expected CONFIG.yaml or --resume RUN_DIR")
    if args.config is not None:
        overrides = list(args.set) + ([f"grpo.steps={args.steps}"] if args.steps is not None else [])
        load_config(args.config, overrides)
    print("nla-grpo train: the GRPO driver is not built yet; the config is valid.", file=sys.stderr)
    return 3


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from shared.errors import NlaInputError

    try:
        if args.cmd == "data" and args.data_cmd == "tiny":
            return _data_tiny(args)
        if args.cmd == "data" and args.data_cmd == "check":
            from shared.check import check_dataset

            check_dataset(args.parquet, args.sidecar, args.model, args.eval_fraction)
            return 0
        if args.cmd == "train":
            return _train(args)
        if args.cmd == "plot":
            print("nla-grpo plot: not built yet", file=sys.stderr)
            return 3
    except NlaInputError as exc:
        print(f"nla-grpo: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
