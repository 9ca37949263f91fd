"""``shared.adapter``: an adapter directory read once, and the linear-only rule every reader applies."""
import json

import pytest

from nla_grpo.shared.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterDir, linear_only_problem
from nla_grpo.shared.errors import NlaInputError


def _adapter(tmp_path, weights="safetensors", **config):
    d = tmp_path / "a"
    d.mkdir(exist_ok=True)
    (d / ADAPTER_CONFIG).write_text(json.dumps({"r": 16, "target_modules": ["q_proj", "v_proj"], **config}))
    if weights:
        (d / ("adapter_model." + weights)).write_bytes(b"x")
    return d


def test_an_adapter_directory_is_read_once_with_its_largest_rank_and_targets(tmp_path):
    a = AdapterDir.read(_adapter(tmp_path, rank_pattern={"down_proj": 64}), "learner.adapter_init")
    assert a.max_rank == 64 and a.targets == ["q_proj", "v_proj"] and a.weights.name == ADAPTER_WEIGHTS
    a.check_files("learner.adapter_init")
    assert AdapterDir.read(_adapter(tmp_path, target_modules="q_proj"), "f").targets == ["q_proj"]


@pytest.mark.parametrize("make,needle", [
    (lambda d: d, r"learner.adapter_init: expected a PEFT adapter directory \(no adapter_config.json\)"),
    (lambda d: (d.mkdir(), (d / ADAPTER_CONFIG).write_text("{"))[0], "adapter_config.json: not valid JSON"),
    (lambda d: (d.mkdir(), (d / ADAPTER_CONFIG).write_text("[1]"))[0], "expected a JSON object, found list"),
])
def test_what_is_not_an_adapter_directory_is_one_line(tmp_path, make, needle):
    d = tmp_path / "nope"
    make(d)
    with pytest.raises(NlaInputError, match=needle):
        AdapterDir.read(d, "learner.adapter_init")


def test_pickled_tensors_and_embedding_loras_are_refused(tmp_path):
    with pytest.raises(NlaInputError, match="expected adapter_model.safetensors, found adapter_model.bin"):
        AdapterDir.read(_adapter(tmp_path, weights="bin"), "f").check_files("f")
    with pytest.raises(NlaInputError, match="target_modules: expected LoRA on linear modules only"):
        AdapterDir.read(_adapter(tmp_path, target_modules=["q_proj", "lm_head"]), "f").check_files("f")
    assert linear_only_problem(["q_proj"]) is None
    assert "modules_to_save=['embed_tokens']" in linear_only_problem(["q_proj"], ["embed_tokens"])
    assert "embed_tokens" in linear_only_problem("embed_tokens")
