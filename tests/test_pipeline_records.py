"""``DIR/pipeline.json`` (``orchestrator.pipeline.StageRecords``): a finished stage made with other pipeline fields
is refused in one line naming the field; a stage whose input stage was redone since is refused; a stage whose
output is gone is not judged (it will be made again); a record survives a reload."""
import pytest

from nla_grpo.orchestrator.pipeline import READS, PipelineConfig, StageRecords, stage_fields
from nla_grpo.shared.errors import NlaInputError


def _cfg(**changes) -> PipelineConfig:
    raw = {"config": "tiny.yaml", "tiny_fixture": True, "extract": {"layer": 0}, "set": ["learner.lora_r=32"]}
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            raw.setdefault(section, {})[field] = value
        else:
            raw[section] = value
    return PipelineConfig.model_validate(raw)


def _finish(out, cfg):
    records = StageRecords(out, cfg)
    for stage, before in READS.items():
        (out / stage).mkdir(exist_ok=True)
        records.done(stage, before, ran=True)
    return records


def test_the_fields_each_stage_depends_on():
    cfg = _cfg()
    assert stage_fields(cfg, "extract")["extract.layer"] == 0 and "explain.model" not in stage_fields(cfg, "extract")
    assert stage_fields(cfg, "rl") == {"config": "tiny.yaml", "seed": 0, "set": ["learner.lora_r=32"], "train.set": []}
    assert "train.steps" not in stage_fields(cfg, "rl")  # RL continues to more steps


def test_a_changed_field_of_a_finished_stage_is_refused_naming_it(tmp_path):
    _finish(tmp_path, _cfg())
    again = StageRecords(tmp_path, _cfg(extract__layer=1))
    with pytest.raises(NlaInputError, match=r"^extract.layer: 0 when .*extract was made, 1 now: its products would mix"):
        again.check_fields("extract", tmp_path / "extract")
    again.check_fields("sft_av", tmp_path / "sft_av")  # the SFT stages' own fields are unchanged
    with pytest.raises(NlaInputError, match=r"^set: \['learner.lora_r=32'\] when"):
        StageRecords(tmp_path, _cfg(set=["learner.lora_r=16"])).check_fields("rl", tmp_path / "rl")
    (tmp_path / "extract").rmdir()  # removed to redo it: nothing to refuse
    again.check_fields("extract", tmp_path / "extract")


def test_a_stage_made_from_an_earlier_run_of_its_input_is_refused(tmp_path):
    records = _finish(tmp_path, _cfg())
    records.check_inputs("rl", tmp_path / "rl", READS["rl"])
    records.done("sft_av", READS["sft_av"], ran=True)  # AV-SFT made again; RL still holds the old one's run
    with pytest.raises(NlaInputError, match=r"rl: made from an earlier run of the sft_av stage"):
        StageRecords(tmp_path, _cfg()).check_inputs("rl", tmp_path / "rl", READS["rl"])
    records.done("sft_ar", READS["sft_ar"], ran=False)  # skipped: its run, and what read it, stay valid
    StageRecords(tmp_path, _cfg()).check_inputs("sft_ar", tmp_path / "sft_ar", READS["sft_ar"])


def test_a_damaged_record_is_one_line(tmp_path):
    (tmp_path / "pipeline.json").write_text("{not json")
    with pytest.raises(NlaInputError, match="pipeline.json: damaged"):
        StageRecords(tmp_path, _cfg())
