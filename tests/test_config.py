import pytest
import yaml

from shared.config import RunConfig, build_config, dump_config, field_docs, load_config
from shared.errors import NlaInputError

from conftest import ROOT


def test_every_field_documented():
    docs = field_docs()
    assert len(docs) > 40
    missing = [k for k, v in docs.items() if not v.strip()]
    assert not missing, f"fields without a doc string: {missing}"


def test_deploy_configs_validate():
    for path in sorted((ROOT / "deploy").glob("*.yaml")):
        if path.name.startswith("runtime-env"):
            continue
        load_config(path)


def test_overrides_and_roundtrip(tmp_path):
    cfg = load_config(ROOT / "deploy/tiny.yaml", ["grpo.steps=7", "rollout.prefill=<x>", "critic.train=false"])
    assert cfg.grpo.steps == 7 and cfg.rollout.prefill == "<x>" and cfg.critic.train is False
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize("raw,needle", [
    ({"rollout": {"temprature": 1.0}}, "rollout.temprature: unknown key"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"rollout": {"group_size": "eight"}}, "rollout.group_size"),
    ({"rollout": {"group_size": 1}}, "rollout.group_size"),
    ({"rollout": {"temperature": 0.7}}, "rollout.temperature: expected 1.0"),
    ({"grpo": {"clip_eps": 1.5}}, "grpo.clip_eps"),
    ({"learner": {"target_modules": ["embed_tokens"]}}, "learner.target_modules"),
    ({"learner": {"micro_batch": 0}}, "learner.micro_batch: expected 'auto' or an integer 1..4096, found 0"),
    ({"learner": {"micro_batch": "most"}}, "learner.micro_batch: expected 'auto' or an integer 1..4096, found 'most'"),
    ({"learner": {"forward": "fused"}}, "learner.forward"),
    ({"placement": {"mode": "cluster"}}, "placement.mode"),
    ({"critic": {"train": "yes"}}, "critic.train"),
])
def test_bad_config_names_field(raw, needle):
    with pytest.raises(NlaInputError) as exc:
        build_config(raw, "my.yaml")
    msg = str(exc.value)
    assert msg.startswith("my.yaml: ") and needle in msg and "\n" not in msg


def test_bad_override_and_files(tmp_path):
    with pytest.raises(NlaInputError, match="expected key=value"):
        build_config({}, "c", ["grpo.steps"])
    with pytest.raises(NlaInputError, match="rollout.max_new_tokens"):
        build_config({}, "c", ["rollout.max_new_tokens=0"])
    with pytest.raises(NlaInputError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed")
    with pytest.raises(NlaInputError, match="not valid YAML"):
        load_config(bad)
    assert RunConfig().rollout.temperature == 1.0
    assert yaml.safe_load(dump_config(RunConfig()))["grpo"]["kl_beta"] == 0.04


@pytest.mark.parametrize("raw,needle", [
    ({"model": {"load_in_4bit": True}}, "model.load_in_4bit"),
    ({"rollout": {"sleep_during_update": True}}, "rollout.sleep_during_update needs placement.mode=colocated"),
    ({"placement": {"mode": "split"}, "model": {"dtype": "float32"}}, "model.dtype=float32 with the vLLM rollout"),
    ({"placement": {"mode": "split", "learner_gpus": 2}}, "placement.learner_gpus: expected 1"),
    ({"placement": {"mode": "colocated"}, "critic": {"lora_r": 8}, "rollout": {"num_engines": 2}}, "rollout.num_engines=1"),
])
def test_rules_across_fields_are_refused_by_the_schema_itself(raw, needle):
    # no model, data or tokenizer behind these paths: the schema alone refuses what training would
    with pytest.raises(NlaInputError) as exc:
        build_config(raw, "my.yaml")
    assert str(exc.value).startswith("my.yaml: ") and needle in str(exc.value)


def test_learner_gpus_zero_is_only_wrong_where_it_is_used():
    assert build_config({"placement": {"mode": "cpu", "learner_gpus": 0}}, "c").placement.learner_gpus == 0
    with pytest.raises(NlaInputError, match="placement.learner_gpus: expected 1"):
        build_config({"placement": {"mode": "cpu", "learner_gpus": 2}}, "c")
