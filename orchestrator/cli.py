"""The ``nla-grpo`` command. Heavy libraries are imported inside each subcommand so --help is instant."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's default after its description, where it has one worth saying (not None, False or [])."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        # by identity: 0 == False (and 0 in (None, False)) would hide a default of 0
        if (default is None or default is False or default == [] or default is argparse.SUPPRESS or "default" in text
                or not action.option_strings and action.nargs not in ("?", "*")):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """The command's parsers, each subcommand's too (argparse makes them of the parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _add_overrides(parser, help: str) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=help)


def _group(sub, name: str, help: str):
    """A command with subcommands (``nla-grpo NAME SUBCOMMAND``); the choice lands in ``args.<NAME>_cmd``."""
    return sub.add_parser(name, help=help).add_subparsers(dest=f"{name}_cmd", required=True)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nla-grpo", description="Train natural language autoencoders with GRPO on Ray + vLLM.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="run (or resume) a GRPO job")
    t.add_argument("config", nargs="?", help="run config YAML (see deploy/)")
    t.add_argument("--run-dir", help="run directory (default runs/<config name>-<time>)")
    t.add_argument("--steps", type=int, help="total step count to reach (default: the config's grpo.steps)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    _add_overrides(t, "override a config field, e.g. grpo.steps=10")

    cc = _group(sub, "config", "run configs: check one before submitting it").add_parser("check", help="validate a run config as `train` would (schema, cross-field rules, model "
                          "config, sidecar, tokenizer, data) without loading weights or starting Ray; one ok line")
    cc.add_argument("config", help="run config YAML (see deploy/)")
    cc.add_argument("--show", action="store_true", help="also print the config resolved (every field, defaults filled in) as YAML")
    cc.add_argument("--gpu-gib", type=float, metavar="GIB",
                    help="placement colocated: the memory plan on a GPU of this many GiB (what CUDA reports: 79.2 for an 80 GB "
                         "card, 139.8 for a 141 GB one), each phase's planned peak; refused in one line where a phase "
                         "does not fit")
    _add_overrides(cc, "override a config field, e.g. grpo.steps=10")

    dsub = _group(sub, "data", "datasets: the tiny fixture, activations from a corpus, teacher explanations, checks")
    dt = dsub.add_parser("tiny", help="write a tiny Qwen3, tokenizer, RL parquet and sidecar")
    dt.add_argument("out_dir", help="an empty or new directory: model/, rl.parquet and its sidecar go there")
    dt.add_argument("--seed", type=int, default=0, help="seed of the random model's weights and of the data")
    de = dsub.add_parser("extract", help="build the RL dataset (and SFT splits) from a subject model and a corpus")
    de.add_argument("corpus", help="parquet or JSONL of documents: 'text', optional 'doc_id'")
    de.add_argument("--model", required=True, help="the subject model's directory")
    de.add_argument("--layer", type=int, required=True, help="the residual stream after this decoder block (0-based)")
    de.add_argument("--out", required=True, help="output directory: <split>.parquet + sidecars")
    de.add_argument("--positions-per-doc", type=int, default=10, help="token positions sampled from each document, one row each")
    de.add_argument("--min-position", type=int, default=50, help="first token position a vector may come from")
    de.add_argument("--max-docs", type=int, help="stop after this many documents (default: the whole corpus)")
    de.add_argument("--splits", default="av_sft=0.25,ar_sft=0.25,rl=0.5", help="document shares per split (a hash of doc_id)")
    de.add_argument("--seed", type=int, default=0, help="seed of the positions sampled in each document")
    de.add_argument("--max-tokens", type=int, default=512, help="documents are cut to this many tokens")
    de.add_argument("--batch-size", type=int, default=16, help="documents per forward")
    de.add_argument("--chunk-docs", type=int, default=256, help="documents per row group (and per resumable step)")
    de.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda, cuda:N or cpu")
    de.add_argument("--workers", type=int, default=1, help="Ray tasks over the corpus's chunks: one per GPU (or CPU share)")
    de.add_argument("--injection-char", default="※", help="the marker character (one token in the tokenizer)")
    de.add_argument("--injection-scale", default="sqrt_d_model", help="recorded in the sidecar: a number, sqrt_d_model or raw")
    de.add_argument("--mse-scale", default="sqrt_d_model", help="recorded in the sidecar: a number, sqrt_d_model or raw")
    from nla_grpo.dataprep.explain import add_arguments as explain_arguments

    explain_arguments(dsub.add_parser("explain", help="a teacher LLM's explanation for every row of the av_sft and ar_sft "
                                                      "splits -> <split>.explained.parquet (resumable)"))
    dc = dsub.add_parser("check", help="validate an RL parquet against its sidecar and tokenizer")
    dc.add_argument("parquet", help="the RL parquet (rows of an activation and its document's context)")
    dc.add_argument("--sidecar", help="sidecar YAML (default <parquet>.nla_meta.yaml)")
    dc.add_argument("--model", help="model/tokenizer directory (default: the sidecar's base_model when local)")
    dc.add_argument("--eval-fraction", type=float, default=0.1, help="share of documents held out for evals, as data.eval_fraction")
    dc.add_argument("--config", help="a run config: also check what training on this parquet with it checks "
                    "(its prefill, stop tokens, karvonen layer, batch size, eval rows)")
    _add_overrides(dc, "override a field of --config")

    ssub = _group(sub, "sft", "the SFT stages before RL: AV-SFT makes learner.adapter_init, AR-SFT critic.checkpoint")
    for stage, what in (("av", "AV-SFT: the verbaliser's LoRA learns the teacher's explanations from the injected activation "
                                "-> RUN_DIR/adapter"),
                        ("ar", "AR-SFT: the critic learns to map explanations back to activations -> RUN_DIR/critic")):
        sp = ssub.add_parser(stage, help=what)
        sp.add_argument("config", nargs="?", help="the run config (its sft section, model, prompts, injection, learner, critic)")
        sp.add_argument("--run-dir", help=f"run directory (default runs/<config name>-sft-{stage}-<time>)")
        sp.add_argument("--steps", type=int, help=f"total step count to reach (sft.{stage}.steps)")
        sp.add_argument("--resume", metavar="RUN_DIR", help="continue the stage in RUN_DIR from its last checkpoint")
        _add_overrides(sp, f"override a config field, e.g. sft.{stage}.lr=1e-4")

    ci = _group(sub, "critic", "AR checkpoints").add_parser("import-reference", help="convert the reference trainer's AR-LoRA directory "
                         "(ar_meta.json + ar_lora_value_head.safetensors) into a critic.checkpoint directory")
    ci.add_argument("ar_dir", help="the reference trainer's AR-LoRA directory")
    ci.add_argument("out_dir", help="the critic checkpoint directory to write (new or empty)")
    ci.add_argument("--model", required=True, help="the base model directory the AR-LoRA sits on")

    ir = sub.add_parser("import-run", help="turn the reference trainer's iter_NNNNNN checkpoint into a run directory "
                        "that `train --resume` continues")
    ir.add_argument("iter_dir", help="the reference trainer's iter_NNNNNN (policy adapter, critic/, training_state.pt)")
    ir.add_argument("--av-sft", required=True, help="the AV-SFT adapter that run started from: the KL reference")
    ir.add_argument("--config", required=True, help="the run config to continue with (see deploy/reference-compatible.yaml)")
    ir.add_argument("--run-dir", required=True, help="the new run directory")
    _add_overrides(ir, "override a config field")

    pp = sub.add_parser("pipeline", help="corpus -> extract -> explain -> sft av -> sft ar -> train, each stage skipped "
                        "when its output is there and valid (deploy/pipeline-*.yaml)")
    pp.add_argument("pipeline", help="pipeline YAML (see deploy/pipeline-tiny.yaml)")
    pp.add_argument("--run-dir", required=True, help="every stage's output goes under this directory")
    _add_overrides(pp, "override a pipeline field, e.g. explain.base_url=http://127.0.0.1:8000/v1")

    dr = sub.add_parser("doctor", help="what this node has for a run: versions, CUDA devices, vLLM and its plugin, "
                        "bitsandbytes, the Ray cluster of RAY_ADDRESS, free disk at the run directory")
    dr.add_argument("--run-dir", default="runs", help="where runs will be written (its free disk is reported)")
    dr.add_argument("--ray-timeout", type=float, default=30.0, help="seconds to wait for the cluster of RAY_ADDRESS")

    from nla_grpo.readout import add_arguments as read_arguments

    read_arguments(sub.add_parser("read", help="read documents with a trained NLA: an explanation, MSE and FVE per token "
                                                "position -> DIR/readout.parquet and DIR/readout.html (resumable)"))

    ex = sub.add_parser("export", help="a trained NLA as a merged Hugging Face verbaliser (with its nla_meta.yaml) and its "
                        "reconstructor (this project's critic and the AR-LoRA layout), for other tools and `read`")
    ex.add_argument("nla", help="a pipeline run or an RL run (its newest checkpoint)")
    ex.add_argument("out", help="the directory to write (new)")

    pl = sub.add_parser("plot", help="write PNG curves of a run's metrics")
    pl.add_argument("run_dir", help="a run directory (its metrics.jsonl); the PNGs go to RUN_DIR/plots")
    return p


def _data_tiny(args) -> int:
    from nla_grpo.dataprep.tiny import tiny_command

    return tiny_command(args.out_dir, seed=args.seed)


def _data_check(args) -> int:
    from pathlib import Path

    from nla_grpo.dataprep.check import check_dataset

    if args.config is None:
        if args.set:
            from nla_grpo.shared.errors import NlaInputError

            raise NlaInputError("data check", "--set needs --config")
        check_dataset(args.parquet, args.sidecar, args.model, args.eval_fraction)
        return 0
    from nla_grpo.dataprep.check import report
    from nla_grpo.orchestrator.job import absolute_paths, prepare_job
    from nla_grpo.shared.config import load_config

    here = [f"data.parquet={Path(args.parquet).resolve()}"]
    here += [f"data.sidecar={Path(args.sidecar).resolve()}"] if args.sidecar else []
    here += [f"model.path={Path(args.model).resolve()}"] if args.model else []
    cfg = absolute_paths(load_config(args.config, list(args.set) + here), Path.cwd())
    # the data read and checked once, as `train` reads it (the model, sidecar, tokenizer, rows, split, prompts and
    # every rule of the config about them), then reported
    job = prepare_job(cfg, log=lambda m: None)
    report(cfg.data.parquet, job.spec, cfg.model.path, job.train, job.eval, len(job.prompt_ids))
    return 0


def _config_check(args) -> int:
    from pathlib import Path

    from nla_grpo.orchestrator.job import absolute_paths, prepare_job
    from nla_grpo.shared.config import dump_config, load_config

    cfg = absolute_paths(load_config(args.config, args.set), Path.cwd())
    elsewhere = _not_on_this_machine(cfg)
    if elsewhere:  # checked off the node (before `ray job submit`): the schema and the rules, and no more
        if args.gpu_gib is not None:
            from nla_grpo.shared.errors import NlaInputError

            raise NlaInputError("--gpu-gib", f"the memory plan reads the model's config.json and weight sizes: "
                                             f"{elsewhere[0]} is not on this machine")
        ok = (f"ok (schema and cross-field rules): {args.config}: placement {cfg.placement.mode}; not checked, not on this "
              f"machine: {', '.join(elsewhere)} (the job checks them where it starts)")
        if args.show:
            sys.stdout.write(dump_config(cfg) + f"# {ok}\n")
        else:
            print(ok)
        return 0
    job = prepare_job(cfg, log=lambda m: None)
    ok = (f"ok: {args.config}: {cfg.grpo.steps} steps of {cfg.grpo.prompts_per_step} prompts x {cfg.rollout.group_size} "
          f"samples over {len(job.train)} training rows ({len(job.eval)} held out), placement {cfg.placement.mode}")
    if args.gpu_gib is not None:
        from nla_grpo.orchestrator.memory_budget import plan_colocated, summary
        from nla_grpo.shared.errors import NlaInputError

        if cfg.placement.mode != "colocated" or cfg.rollout.backend != "vllm":
            raise NlaInputError("--gpu-gib", f"the memory plan is a colocated vLLM run's: found placement.mode "
                                             f"{cfg.placement.mode}, rollout.backend {cfg.rollout.backend}")
        if not 1 <= args.gpu_gib <= 4096:
            raise NlaInputError("--gpu-gib", f"expected a GPU's memory in GiB (1 to 4096), found {args.gpu_gib:g}")
        plan = plan_colocated(job.cfg, job.spec, int(args.gpu_gib * (1 << 30)))
        print(summary(plan.table, plan.total_bytes).replace("[memory] ", ""), file=sys.stderr if args.show else sys.stdout)
    if args.show:  # as the job resolved it (shared.resolve); the ok line as a comment
        sys.stdout.write(dump_config(job.cfg) + f"# {ok}\n")  # after it, so the output still loads as the config
    else:
        print(ok)
    return 0


def _not_on_this_machine(cfg) -> list[str]:
    """``cfg``'s model and data paths as "field path" where this machine has none of them (a laptop before `ray job
    submit`); [] where it has any: then it is where the job runs, and every check runs (a missing one refused)."""
    from pathlib import Path

    paths = [(name, path) for name, path in (("model.path", cfg.model.path), ("data.parquet", cfg.data.parquet)) if path]
    if any(Path(path).exists() for _, path in paths):
        return []
    return [f"{name} {path}" for name, path in paths]


def _sft(args) -> int:
    from nla_grpo.orchestrator.sft_run import done_line, run_sft

    stage = args.sft_cmd
    last = run_sft(stage, args.config, args.run_dir, args.resume, args.steps, args.set, log=lambda m: print(m, flush=True))
    print(done_line(stage, last))
    return 0


def _resume_hint(args, run_path) -> str:
    """How to continue after an interrupt, true of what this command had written when it stopped."""
    import shlex

    from nla_grpo.orchestrator import pipeline

    if pipeline.RUNNING or args.cmd == "pipeline":
        return "the same `nla-grpo pipeline` command continues: finished stages are skipped and this one goes on where it stopped"
    if args.cmd == "data" and args.data_cmd == "explain":
        from nla_grpo.dataprep.explain import journaled_rows

        rows = journaled_rows(args.splits_dir)
        if rows:
            return f"{rows} answered rows are journaled in {Path(args.splits_dir) / '.explain'}: the same command asks only the rest"
        return "no answer was journaled yet: the same command starts it again"
    if args.cmd == "data" and args.data_cmd == "extract":
        return "the same command continues the extraction where it stopped"
    if args.cmd == "read":
        from nla_grpo.readout import JOURNAL_DIR

        journal = Path(args.out) / JOURNAL_DIR
        if journal.is_dir():
            return f"the documents read so far are journaled in {journal}: the same command reads only the rest"
        return "nothing was written yet: the same command starts it again"
    if args.cmd not in ("train", "sft"):
        return "the same command starts it again"
    if run_path is None or not (Path(run_path) / "config.yaml").is_file():
        return "nothing was written yet: the same command starts it again"
    command = f"nla-grpo sft {args.sft_cmd}" if args.cmd == "sft" else "nla-grpo train"
    return f"it continues from its last checkpoint with `{command} --resume {shlex.quote(str(run_path))}`"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from nla_grpo.orchestrator.driver import stop_on_signals
    from nla_grpo.shared.errors import NlaInputError

    try:
        stop_on_signals()  # SIGTERM ends every command as Ctrl-C does: one line and 143, never a silent kill
        if args.cmd == "data" and args.data_cmd == "tiny":
            return _data_tiny(args)
        if args.cmd == "data" and args.data_cmd == "extract":
            from nla_grpo.dataprep.extract import extract

            written = extract(args.corpus, args.model, args.layer, args.out, args.positions_per_doc, args.min_position,
                              args.max_docs, args.splits, args.seed, args.max_tokens, args.batch_size, args.chunk_docs,
                              device=args.device,
                              injection_char=args.injection_char, injection_scale=args.injection_scale,
                              mse_scale=args.mse_scale, workers=args.workers, log=lambda m: print(m, flush=True))
            print(f"next: nla-grpo data check {written.get('rl', args.out)} && nla-grpo train CONFIG.yaml "
                  f"--set data.parquet={written.get('rl', args.out)} --set model.path={args.model}")
            return 0
        if args.cmd == "data" and args.data_cmd == "explain":
            from nla_grpo.dataprep.explain import run as explain

            return explain(args, log=lambda m: print(m, flush=True))
        if args.cmd == "data" and args.data_cmd == "check":
            return _data_check(args)
        if args.cmd == "train":
            from nla_grpo.orchestrator.rl_run import run_rl

            return run_rl(args.config, args.run_dir, args.resume, args.steps, args.set)
        if args.cmd == "sft":
            return _sft(args)
        if args.cmd == "config" and args.config_cmd == "check":
            return _config_check(args)
        if args.cmd == "critic" and args.critic_cmd == "import-reference":
            from nla_grpo.critic.import_reference import import_reference_ar

            meta = import_reference_ar(args.ar_dir, args.out_dir, args.model)
            print(f"wrote {args.out_dir}: {meta.num_layers} blocks, LoRA r={meta.lora_r} alpha={meta.lora_alpha} on "
                  f"{','.join(meta.target_modules)}; use it with critic.checkpoint={args.out_dir} "
                  f"(critic.lora_r and lora_alpha come from it)"
                  + (f" model.quantization={meta.quantization}" if meta.quantization != "none" else "")
                  + (" (its final norm kept, as it was trained)" if meta.final_norm else ""))
            return 0
        if args.cmd == "import-run":
            from nla_grpo.orchestrator.import_run import import_run

            import_run(args.iter_dir, args.av_sft, args.config, args.run_dir, args.set, log=lambda m: print(m, flush=True))
            return 0
        if args.cmd == "pipeline":
            from nla_grpo.orchestrator.pipeline import run_pipeline

            return run_pipeline(args.pipeline, args.run_dir, args.set)
        if args.cmd == "doctor":
            from nla_grpo.orchestrator.doctor import doctor

            return doctor(args.run_dir, args.ray_timeout)
        if args.cmd == "read":
            from nla_grpo.readout import run_read

            return run_read(args, log=lambda m: print(m, flush=True))
        if args.cmd == "export":
            from nla_grpo.export import export

            out = export(args.nla, args.out, log=lambda m: print(m, flush=True))
            print(f"next: nla-grpo read {out} --text FILE --out DIR")
            return 0
        if args.cmd == "plot":
            from nla_grpo.orchestrator.plot import write_plots

            print(write_plots(args.run_dir))
            return 0
    except NlaInputError as exc:
        for line in str(exc).splitlines():  # several problems at once: a line each
            print(f"nla-grpo: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        from nla_grpo.orchestrator.driver import interrupted_by

        from nla_grpo.orchestrator.run_dir import RunDir

        where = str(exc) if str(exc).startswith(("step ", "starting")) else f"interrupted ({interrupted_by(exc)})"
        print(f"nla-grpo: error: {where}; {_resume_hint(args, RunDir.current)}", file=sys.stderr)
        return 143 if "SIGTERM" in where else 130
    except Exception as exc:
        import os

        from nla_grpo.orchestrator.driver import StepError
        from nla_grpo.shared.errors import one_line

        if os.environ.get("NLA_GRPO_TRACEBACK"):
            raise
        message = str(exc) if isinstance(exc, StepError) else f"{one_line(exc)} (NLA_GRPO_TRACEBACK=1 shows the traceback)"
        print(f"nla-grpo: error: {message}", file=sys.stderr)
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
