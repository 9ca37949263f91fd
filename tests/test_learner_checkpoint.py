"""Checkpoint helpers: optimiser state without pickle, JSON conversion, atomic directories."""
import enum

import pytest
import torch
from safetensors.torch import load_file, save_file

from learner.checkpoint import atomic_directory, join_optimizer_state, jsonable, split_optimizer_state


def test_optimizer_state_round_trips_through_safetensors_and_json(tmp_path):
    import json

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(2):
        sum((p ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
    tensors, meta = split_optimizer_state(opt.state_dict())
    save_file(tensors, str(tmp_path / "o.safetensors"))
    (tmp_path / "o.json").write_text(json.dumps(meta))
    restored = join_optimizer_state(load_file(str(tmp_path / "o.safetensors")), json.loads((tmp_path / "o.json").read_text()))
    fresh = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=5.0)
    fresh.load_state_dict(restored)
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["param_groups"] == b["param_groups"] and isinstance(b["param_groups"][0]["betas"], tuple)
    for pid in a["state"]:
        for key, value in a["state"][pid].items():
            assert torch.equal(value, b["state"][pid][key])


def test_jsonable():
    class Kind(str, enum.Enum):
        LORA = "LORA"

    assert jsonable({"t": {"b", "a"}, "k": Kind.LORA, "x": (1, None)}) == {"t": ["a", "b"], "k": "LORA", "x": [1, None]}
    with pytest.raises(TypeError, match="Tensor"):
        jsonable({"bad": torch.zeros(1)})


def test_atomic_directory_keeps_the_old_one_on_failure(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as d:
        (d / "a.txt").write_text("one")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as d:
            (d / "a.txt").write_text("two")
            raise RuntimeError("crash mid-save")
    assert (target / "a.txt").read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    with atomic_directory(target) as d:
        (d / "a.txt").write_text("three")
    assert (target / "a.txt").read_text() == "three" and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
