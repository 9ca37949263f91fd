"""``nla-grpo pipeline PIPELINE.yaml --run-dir DIR``: the four stages of an NLA, one after the other,
each the very command a user would run by hand, with its output under DIR:

    DIR/tiny/            the tiny fixture, its subject/ model and corpus (``tiny_fixture: true`` only: ``data tiny``)
    DIR/data/            ``data extract``: av_sft / ar_sft / rl parquets and sidecars; then ``data explain``:
                         av_sft.explained.parquet, ar_sft.explained.parquet
    DIR/sft_av/          ``sft av``: a run directory; its adapter/ is the RL run's learner.adapter_init
    DIR/sft_ar/          ``sft ar``: a run directory; its critic/ is the RL run's critic.checkpoint
    DIR/rl/              ``train``: the GRPO run

A stage whose output is there and checks valid is skipped; one left half-way (a killed run) continues
where it stopped, as each command does on its own. The first stage that fails stops the pipeline with
its own one line and exit code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field

from shared.config import _Section
from shared.errors import NlaInputError


class ExtractStage(_Section):
    layer: int = Field(ge=0, le=1024)
    """The residual stream after this decoder block (0-based)."""
    positions_per_doc: int = Field(10, ge=1)
    """Activations taken per document."""
    min_position: int = Field(50, ge=0)
    """First token position a vector may come from."""
    max_docs: Optional[int] = Field(None, ge=1)
    """Read at most this many documents of the corpus."""
    splits: str = "av_sft=0.25,ar_sft=0.25,rl=0.5"
    """Document shares per split."""
    max_tokens: int = Field(512, ge=2)
    """Documents are cut to this many tokens."""
    batch_size: int = Field(16, ge=1)
    """Documents per forward."""
    workers: int = Field(1, ge=1)
    """Ray tasks over the corpus (one per GPU)."""
    injection_scale: str = "sqrt_d_model"
    """Recorded in the sidecars: a number, sqrt_d_model or raw."""


class ExplainStage(_Section):
    base_url: Optional[str] = None
    """The teacher's API (an OpenAI-compatible server such as `vllm serve`, or https://api.anthropic.com); required."""
    model: Optional[str] = None
    """The teacher model's name at that API; required."""
    api: Literal["openai", "anthropic"] = "openai"
    """openai: chat completions; anthropic: the Messages API."""
    api_key_env: Optional[str] = None
    """The environment variable holding the teacher's key (never the key itself)."""
    concurrency: int = Field(8, ge=1, le=1024)
    """Requests in flight."""
    max_rows: Optional[int] = Field(None, ge=1)
    """Explain only the first N rows of each SFT split."""


class TrainStage(_Section):
    steps: Optional[int] = Field(None, ge=1)
    """GRPO steps (None = the run config's grpo.steps)."""


class PipelineConfig(_Section):
    config: str
    """The run config the SFT stages and RL read (relative to this file): model, prompts, injection, learner,
    critic, grpo and sft sections; the pipeline sets its model and file paths."""
    set: list[str] = Field(default_factory=list)
    """Overrides of that config (key=value), applied before the pipeline's own paths."""
    tiny_fixture: bool = False
    """Build the tiny fixture (`nla-grpo data tiny`) under RUN_DIR/tiny and use its subject/ model and corpus.jsonl."""
    model: Optional[str] = None
    """The subject model's directory (relative to this file); ignored with tiny_fixture."""
    corpus: Optional[str] = None
    """The corpus (parquet or JSONL of documents with 'text', optional 'doc_id'; relative to this file)."""
    seed: int = Field(0, ge=0)
    """Seed of the extraction's positions and splits (the run config has its own)."""
    extract: ExtractStage
    explain: ExplainStage = Field(default_factory=ExplainStage)
    train: TrainStage = Field(default_factory=TrainStage)


def load_pipeline(path: str | Path, overrides: list[str]) -> tuple[PipelineConfig, Path]:
    from pydantic import ValidationError

    from shared.config import _describe_error, apply_overrides, read_yaml_file

    p = Path(path)
    if not p.is_file():
        raise NlaInputError(p, "pipeline file not found")
    raw = read_yaml_file(p) or {}
    if not isinstance(raw, dict):
        raise NlaInputError(p, "expected a mapping at the top level")
    raw = apply_overrides(raw, overrides)
    try:
        cfg = PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise NlaInputError(p, _describe_error(exc.errors()[0])) from None
    return cfg, p.resolve().parent


def _stage(name: str, argv: list[str]) -> None:
    """Run one stage as its command; a failure ends the pipeline with that command's exit code."""
    from orchestrator.cli import main

    print(f"[pipeline] {name}: nla-grpo {' '.join(argv)}", flush=True)
    rc = main(argv)
    if rc != 0:
        raise SystemExit(rc)


def _split_problem(parquet: Path, model: str) -> str | None:
    """Why an extracted split would not do (``data check``'s line), or None."""
    import io

    from dataprep.check import check_dataset

    try:
        check_dataset(str(parquet), model_dir=model, out=io.StringIO())
    except NlaInputError as exc:
        return str(exc)
    return None


def run_pipeline(path: str | Path, run_dir: str | Path, overrides: list[str]) -> int:
    cfg, here = load_pipeline(path, overrides)
    for field in ("base_url", "model"):  # before anything is written
        if not getattr(cfg.explain, field):
            raise NlaInputError("pipeline", f"explain.{field}: the teacher's {field.replace('_', ' ')} is needed "
                                            f"(--set explain.{field}=...)")
    from shared.ray_cluster import check_durable

    check_durable(run_dir, given=True)
    out = Path(run_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _run(cfg, here, out)
    except SystemExit as stop:
        return int(stop.code or 0)


def _run(cfg: PipelineConfig, here: Path, out: Path) -> int:
    def rel(p):
        return str((here / p).resolve()) if p and not Path(p).is_absolute() else p

    # ---- the subject model and the corpus ---------------------------------------------------------
    if cfg.tiny_fixture:
        tiny = out / "tiny"
        if (tiny / "subject" / "config.json").is_file() and (tiny / "corpus.jsonl").is_file():
            print(f"[pipeline] tiny fixture: {tiny} is there, skipped", flush=True)
        else:
            _stage("tiny fixture", ["data", "tiny", str(tiny), "--seed", str(cfg.seed)])
        model, corpus = str(tiny / "subject"), str(tiny / "corpus.jsonl")  # dataprep.tiny: its block 0 writes softly
    else:
        if not cfg.model or not cfg.corpus:
            raise NlaInputError("pipeline", "model and corpus: both needed (or tiny_fixture: true)")
        model, corpus = rel(cfg.model), rel(cfg.corpus)

    # ---- 1. activations ----------------------------------------------------------------------------
    data = out / "data"
    splits = [data / f"{s}.parquet" for s in ("av_sft", "ar_sft", "rl")]
    if all(p.is_file() for p in splits) and not (data / ".extract").exists():
        for p in splits:
            problem = _split_problem(p, model)
            if problem:
                raise NlaInputError(data, f"holds splits that do not check valid ({problem}); remove it to extract again")
        print(f"[pipeline] extract: {data} is there and checks valid, skipped", flush=True)
    else:
        e = cfg.extract
        argv = ["data", "extract", corpus, "--model", model, "--layer", str(e.layer), "--out", str(data),
                "--positions-per-doc", str(e.positions_per_doc), "--min-position", str(e.min_position),
                "--splits", e.splits, "--seed", str(cfg.seed), "--max-tokens", str(e.max_tokens),
                "--batch-size", str(e.batch_size), "--workers", str(e.workers), "--injection-scale", e.injection_scale]
        _stage("extract", argv + (["--max-docs", str(e.max_docs)] if e.max_docs else []))

    # ---- 2. explanations ---------------------------------------------------------------------------
    x = cfg.explain
    argv = ["data", "explain", str(data), "--base-url", x.base_url, "--model", x.model, "--api", x.api,
            "--concurrency", str(x.concurrency)]
    argv += (["--api-key-env", x.api_key_env] if x.api_key_env else []) + (["--max-rows", str(x.max_rows)] if x.max_rows else [])
    _stage("explain", argv)  # a split already explained in full is skipped by the command itself

    # ---- 3. SFT ------------------------------------------------------------------------------------
    paths = [f"model.path={model}", f"data.parquet={data / 'rl.parquet'}", "data.sidecar=null"]
    config = rel(cfg.config)
    products = {"av": out / "sft_av" / "adapter" / "adapter_config.json", "ar": out / "sft_ar" / "critic" / "critic_meta.json"}
    for stage in ("av", "ar"):
        run = out / f"sft_{stage}"
        if products[stage].is_file():
            print(f"[pipeline] sft {stage}: {products[stage].parent} is there, skipped", flush=True)
        elif (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("step_*")):
            _stage(f"sft {stage}", ["sft", stage, "--resume", str(run)])
        else:
            import shutil

            shutil.rmtree(run, ignore_errors=True)  # a stage that failed before its first checkpoint: from the start
            _stage(f"sft {stage}", ["sft", stage, config, "--run-dir", str(run)]
                   + [a for o in list(cfg.set) + paths for a in ("--set", o)])

    # ---- 4. RL -------------------------------------------------------------------------------------
    rl = out / "rl"
    paths += [f"learner.adapter_init={products['av'].parent}", f"critic.checkpoint={products['ar'].parent}",
              "critic.lora_r=null", "critic.lora_alpha=null"]
    steps = ["--steps", str(cfg.train.steps)] if cfg.train.steps else []
    if (rl / "checkpoints").is_dir() and any((rl / "checkpoints").glob("step_*")):
        from orchestrator.run_dir import RunDir

        last = RunDir(rl).latest_checkpoint()
        want = cfg.train.steps or RunDir.open(rl).config().grpo.steps
        if last is not None and int(last.name.removeprefix("step_")) >= want:
            print(f"[pipeline] train: {rl} is at step {want}, skipped", flush=True)
        else:
            _stage("train", ["train", "--resume", str(rl)] + steps)
    else:
        import shutil

        shutil.rmtree(rl, ignore_errors=True)
        _stage("train", ["train", config, "--run-dir", str(rl)] + steps + [a for o in list(cfg.set) + paths for a in ("--set", o)])
    print(f"[pipeline] done: {out} (AV-SFT {products['av'].parent}, AR-SFT {products['ar'].parent}, RL {rl})", flush=True)
    return 0
