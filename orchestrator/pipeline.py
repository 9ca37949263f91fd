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

``DIR/pipeline.json`` records the pipeline fields each stage was made with and which run of the stage
before it it read. A rerun whose fields differ for a stage that is already there (another
``extract.layer``, say) is refused in one line naming the field, before anything runs: its products
would mix with the new request's. So is a stage made from an earlier run of the stage before it.

At the end one summary line per stage says what it reached: AV-SFT's and AR-SFT's held-out figures,
RL's held-out FVE at step 0 (before any update) and at its last eval.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field

from nla_grpo.shared.config import _Section
from nla_grpo.shared.errors import NlaInputError

RUNNING = False  # set while run_pipeline runs its stages (an interrupted stage then names the pipeline's resume)


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
    teacher: Optional[Literal["fixture"]] = None
    """fixture: the tiny fixture's rule (the explanation is the marked token; dataprep/fixture_teacher.py) instead of
    a teacher at base_url; with tiny_fixture and no base_url it is what the pipeline takes. Never for real data."""
    base_url: Optional[str] = None
    """The teacher's API (an OpenAI-compatible server such as `vllm serve`, or https://api.anthropic.com); required
    unless teacher is fixture."""
    model: Optional[str] = None
    """The teacher model's name at that API; required unless teacher is fixture."""
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
    set: list[str] = Field(default_factory=list)
    """Overrides of the run config for RL alone (after the pipeline's `set`): a start from SFT products wants
    other rates than a fresh adapter (deploy/pipeline-tiny.yaml says which and why)."""


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
    """Seed of everything the pipeline makes: the tiny fixture, the extraction's positions and splits, and the run
    config's own seed for SFT and RL (a `set` entry seed=N still overrides that)."""
    extract: ExtractStage
    explain: ExplainStage = Field(default_factory=ExplainStage)
    train: TrainStage = Field(default_factory=TrainStage)


def load_pipeline(path: str | Path, overrides: list[str]) -> tuple[PipelineConfig, Path]:
    from pydantic import ValidationError

    from nla_grpo.shared.config import _describe_error, apply_overrides, read_yaml_file

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


def _log(message: str) -> None:
    print(message, flush=True)


def _announce(name: str, what: str) -> None:
    """The stage about to run, as ``[pipeline] NAME: WHAT``; a stage's failure raises and ends the pipeline there."""
    _log(f"[pipeline] {name}: {what}")


def _split_problem(parquet: Path, model: str) -> str | None:
    """Why an extracted split would not do (``data check``'s line), or None."""
    import io

    from nla_grpo.dataprep.check import check_dataset

    try:
        check_dataset(str(parquet), model_dir=model, out=io.StringIO())
    except NlaInputError as exc:
        return str(exc)
    return None


# the pipeline fields each stage's output depends on (train.steps is not one: RL continues to more steps)
STAGE_FIELDS = {
    "tiny": ("tiny_fixture", "seed"),
    "extract": ("tiny_fixture", "model", "corpus", "seed", "extract."),
    "explain": ("explain.teacher", "explain.model", "explain.api", "explain.max_rows"),
    "sft_av": ("config", "set", "seed"),
    "sft_ar": ("config", "set", "seed"),
    "rl": ("config", "set", "seed", "train.set"),
}
RECORD = "pipeline.json"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def stage_fields(cfg: PipelineConfig, stage: str) -> dict:
    """The pipeline fields ``stage`` is made with (``STAGE_FIELDS``), flattened."""
    flat = _flat(cfg.model_dump(mode="json"))
    return {k: v for k, v in sorted(flat.items()) if k.startswith(STAGE_FIELDS[stage])}


class StageRecords:
    """``DIR/pipeline.json``: per stage the fields it was made with and the run of the stage before it that it
    read (each run of a stage gets a new number), written as each stage finishes."""

    def __init__(self, out: Path, cfg: PipelineConfig):
        import json

        self.path, self.cfg, self.out = out / RECORD, cfg, out
        try:
            self.stages = json.loads(self.path.read_text())["stages"] if self.path.is_file() else {}
        except (ValueError, KeyError, TypeError):
            raise NlaInputError(self.path, "damaged: expected the pipeline's stage record (remove it to adopt the "
                                           "stages as they are)") from None

    def check_fields(self, stage: str, output: Path) -> None:
        """Refuse, in one line naming the field, an existing ``output`` made with other pipeline fields."""
        rec = self.stages.get(stage)
        if rec is None or not output.exists():
            return
        now = stage_fields(self.cfg, stage)
        for key in sorted(set(now) | set(rec["fields"])):
            if now.get(key) != rec["fields"].get(key):
                raise NlaInputError(key, f"{rec['fields'].get(key)!r} when {output} was made, {now.get(key)!r} now: its "
                                         f"products would mix with this request's; use another --run-dir, or remove {output} "
                                         "and the stages after it to redo them")

    def check_inputs(self, stage: str, output: Path, before: tuple[str, ...]) -> None:
        """Refuse to keep ``output`` when a stage it read from has been redone since."""
        rec = self.stages.get(stage)
        if rec is None:
            return
        for b in before:
            if b in self.stages and (rec.get("after") or {}).get(b) != self.stages[b]["run"]:
                raise NlaInputError(output, f"made from an earlier run of the {b} stage than the one there now: remove it "
                                            "and the stages after it to redo them")

    def done(self, stage: str, before: tuple[str, ...], ran: bool) -> None:
        from nla_grpo.shared.fileio import write_json

        old = self.stages.get(stage)
        run = (max((r["run"] for r in self.stages.values()), default=0) + 1) if ran or old is None else old["run"]
        self.stages[stage] = {"fields": stage_fields(self.cfg, stage), "run": run,
                              "after": {b: self.stages[b]["run"] for b in before if b in self.stages}}
        write_json(self.path, {"stages": self.stages})


# each stage and the stages whose output it reads
READS = {"tiny": (), "extract": ("tiny",), "explain": ("extract",), "sft_av": ("explain",), "sft_ar": ("explain",),
         "rl": ("sft_av", "sft_ar")}


def run_pipeline(path: str | Path, run_dir: str | Path, overrides: list[str]) -> int:
    global RUNNING
    cfg, here = load_pipeline(path, overrides)
    if cfg.explain.teacher is None and not cfg.explain.base_url and not cfg.explain.model and cfg.tiny_fixture:
        cfg = cfg.model_copy(update={"explain": cfg.explain.model_copy(update={"teacher": "fixture"})})
    if cfg.explain.teacher is None:
        for field in ("base_url", "model"):  # before anything is written
            if not getattr(cfg.explain, field):
                raise NlaInputError("pipeline", f"explain.{field}: the teacher's {field.replace('_', ' ')} is needed "
                                                f"(--set explain.{field}=...)")
    from nla_grpo.shared.ray_cluster import check_durable

    check_durable(run_dir, given=True)
    out = Path(run_dir).resolve()
    if out.exists() and not out.is_dir():
        raise NlaInputError(out, "not a directory (expected the pipeline's run directory)")
    for name in ("tiny", "data", "sft_av", "sft_ar", "rl"):  # a stage's output of the wrong kind: before anything runs
        if (out / name).exists() and not (out / name).is_dir():
            raise NlaInputError(out / name, "not a directory (expected the pipeline's own output of that stage): move it away")
    records = StageRecords(out, cfg)
    outputs = {"tiny": out / "tiny", "extract": out / "data", "explain": out / "data", "sft_av": out / "sft_av",
               "sft_ar": out / "sft_ar", "rl": out / "rl"}
    for stage in READS:
        records.check_fields(stage, outputs[stage])
    out.mkdir(parents=True, exist_ok=True)
    RUNNING = True
    try:
        return _run(cfg, here, out, records)
    except SystemExit as stop:
        return int(stop.code or 0)
    finally:
        RUNNING = False


def _summary(out: Path, log=print) -> None:
    """One line per stage from its metrics: what AV-SFT and AR-SFT reached, where RL started (step 0) and ended."""
    from nla_grpo.orchestrator.run_dir import RunDir

    def evals(run, key):
        return [(r["step"], r[key]) for r in RunDir(out / run).read_metrics() if isinstance(r.get(key), (int, float))]

    for name, run, key, what in (("AV-SFT", "sft_av", "eval/nll", "held-out token NLL"), ("AR-SFT", "sft_ar", "eval/fve", "held-out FVE")):
        pts = evals(run, key)
        if pts:
            log(f"[summary] {name}: {what} {pts[0][1]:.3f} at step {pts[0][0]} -> {pts[-1][1]:.3f} at step {pts[-1][0]}")
    rows = [r for r in RunDir(out / "rl").read_metrics() if isinstance(r.get("eval/fve"), (int, float))]
    if rows:
        first, last = rows[0], rows[-1]

        def at(r):
            nonempty = r.get("eval/nonempty_rate")
            return (f"{r['eval/fve']:+.3f} at step {r['step']}"
                    + (f" ({nonempty:.0%} non-empty)" if isinstance(nonempty, (int, float)) else ""))

        lowest = min(rows, key=lambda r: r["eval/fve"])
        log(f"[summary] RL: held-out FVE {at(first)} -> {at(last)}; lowest {lowest['eval/fve']:+.3f} at step {lowest['step']}")


def _run(cfg: PipelineConfig, here: Path, out: Path, records: StageRecords) -> int:
    def rel(p):
        return str((here / p).resolve()) if p and not Path(p).is_absolute() else p

    # ---- the subject model and the corpus ---------------------------------------------------------
    if cfg.tiny_fixture:
        tiny = out / "tiny"
        if (tiny / "subject" / "config.json").is_file() and (tiny / "corpus.jsonl").is_file():
            print(f"[pipeline] tiny fixture: {tiny} is there, skipped", flush=True)
            records.done("tiny", READS["tiny"], ran=False)
        else:
            from nla_grpo.dataprep.tiny import tiny_command

            _announce("tiny fixture", f"the tiny subject model and corpus into {tiny} (seed {cfg.seed})")
            tiny_command(tiny, seed=cfg.seed, log=_log)
            records.done("tiny", READS["tiny"], ran=True)
        model, corpus = str(tiny / "subject"), str(tiny / "corpus.jsonl")  # dataprep.tiny: its block 0 writes softly
    else:
        if not cfg.model or not cfg.corpus:
            raise NlaInputError("pipeline", "model and corpus: both needed (or tiny_fixture: true)")
        model, corpus = rel(cfg.model), rel(cfg.corpus)

    # ---- 1. activations ----------------------------------------------------------------------------
    data = out / "data"
    splits = [data / f"{s}.parquet" for s in ("av_sft", "ar_sft", "rl")]
    if all(p.is_file() for p in splits) and not (data / ".extract").exists():
        records.check_inputs("extract", data, READS["extract"])
        for p in splits:
            problem = _split_problem(p, model)
            if problem:
                raise NlaInputError(data, f"holds splits that do not check valid ({problem}); remove it to extract again")
        print(f"[pipeline] extract: {data} is there and checks valid, skipped", flush=True)
        records.done("extract", READS["extract"], ran=False)
    else:
        from nla_grpo.dataprep.extract import extract

        e = cfg.extract
        _announce("extract", f"block {e.layer}'s residuals of {model} over {corpus} into {data}")
        extract(corpus, model, e.layer, data, positions_per_doc=e.positions_per_doc, min_position=e.min_position,
                max_docs=e.max_docs, splits=e.splits, seed=cfg.seed, max_tokens=e.max_tokens, batch_size=e.batch_size,
                workers=e.workers, injection_scale=e.injection_scale, log=_log)
        records.done("extract", READS["extract"], ran=True)

    # ---- 2. explanations ---------------------------------------------------------------------------
    x = cfg.explain
    explained = all((data / f"{s}_sft.explained.parquet").is_file() for s in ("av", "ar"))
    if explained:
        records.check_inputs("explain", data, READS["explain"])
    from nla_grpo.dataprep.explain import explain_command

    teacher = "the tiny fixture's rule" if x.teacher == "fixture" else f"{x.model} at {x.base_url}"
    _announce("explain", f"the SFT splits in {data} by {teacher}")
    fixture = x.teacher == "fixture"  # a split already explained in full is skipped by the stage itself
    explain_command(data, teacher=x.teacher, base_url=None if fixture else x.base_url, model=None if fixture else x.model,
                    api=x.api, api_key_env=None if fixture else x.api_key_env, concurrency=x.concurrency,
                    max_rows=x.max_rows, log=_log)
    records.done("explain", READS["explain"], ran=not explained)

    # ---- 3. SFT ------------------------------------------------------------------------------------
    paths = [f"model.path={model}", f"data.parquet={data / 'rl.parquet'}", "data.sidecar=null"]
    sets = [f"seed={cfg.seed}"] + list(cfg.set)  # the pipeline's seed, unless its `set` names another
    config = rel(cfg.config)
    from nla_grpo.critic.checkpoint import META_NAME
    from nla_grpo.orchestrator.run_dir import RunDir
    from nla_grpo.orchestrator.sft_run import done_line, run_sft
    from nla_grpo.shared.adapter import ADAPTER_CONFIG

    products = {stage: RunDir(out / f"sft_{stage}", stage).product / name for stage, name in (("av", ADAPTER_CONFIG), ("ar", META_NAME))}

    for stage in ("av", "ar"):
        run = out / f"sft_{stage}"
        if products[stage].is_file():
            records.check_inputs(f"sft_{stage}", run, READS[f"sft_{stage}"])
            print(f"[pipeline] sft {stage}: {products[stage].parent} is there, skipped", flush=True)
            records.done(f"sft_{stage}", READS[f"sft_{stage}"], ran=False)
            continue
        if RunDir(run, stage).list_checkpoints():
            _announce(f"sft {stage}", f"{run} continued from its last checkpoint")
            last = run_sft(stage, None, None, str(run), None, [], log=_log)
        else:
            import shutil

            shutil.rmtree(run, ignore_errors=True)  # a stage that failed before its first checkpoint: from the start
            _announce(f"sft {stage}", f"{config} into {run}")
            last = run_sft(stage, config, str(run), None, None, sets + paths, log=_log)
        _log(done_line(stage, last))
        records.done(f"sft_{stage}", READS[f"sft_{stage}"], ran=True)

    # ---- 4. RL -------------------------------------------------------------------------------------
    rl = out / "rl"
    paths += [f"learner.adapter_init={products['av'].parent}", f"critic.checkpoint={products['ar'].parent}",
              "critic.lora_r=null", "critic.lora_alpha=null"]
    from nla_grpo.orchestrator.rl_run import run_rl

    if RunDir(rl).list_checkpoints():
        records.check_inputs("rl", rl, READS["rl"])
        last = RunDir(rl).latest_checkpoint()
        want = cfg.train.steps or RunDir.open(rl).config().grpo.steps
        ran = not (last is not None and int(last.name.removeprefix("step_")) >= want)
        if not ran:
            print(f"[pipeline] train: {rl} is at step {want}, skipped", flush=True)
        else:
            _announce("train", f"{rl} continued from its last checkpoint")
            run_rl(resume=str(rl), steps=cfg.train.steps or None)
    else:
        import shutil

        shutil.rmtree(rl, ignore_errors=True)
        ran = True
        _announce("train", f"{config} into {rl}, from the SFT products")
        run_rl(config, str(rl), steps=cfg.train.steps or None, overrides=sets + list(cfg.train.set) + paths)
    records.done("rl", READS["rl"], ran=ran)
    _summary(out)
    print(f"[pipeline] done: {out} (AV-SFT {products['av'].parent}, AR-SFT {products['ar'].parent}, RL {rl})", flush=True)
    return 0
