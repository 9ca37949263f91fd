"""Checkpoint helpers: optimiser state without pickle, JSON conversion, atomic directories."""
import enum

import pytest
import torch
from safetensors.torch import load_file, save_file

from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.fileio import atomic_directory, join_optimizer_state, jsonable, split_optimizer_state


def _trained_adamw():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(2):
        sum((p ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
    return params, opt


def test_optimizer_state_round_trips_through_safetensors_and_json(tmp_path):
    import json

    params, opt = _trained_adamw()
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


def test_a_nested_quantised_state_round_trips_exactly(tmp_path):
    """bitsandbytes' 8-bit AdamW keeps its quantised moments in a dict under one key of each
    parameter's state (uint8 moments, float32 absmax and maps, an int step beside): the layout here."""
    import json

    nested = "__bnb_optimizer_quant_state__"
    state = {"state": {0: {"step": 3, nested: {"state1": torch.randint(0, 255, (8, 4), dtype=torch.uint8),
                                               "state2": torch.randint(0, 255, (8, 4), dtype=torch.uint8),
                                               "absmax1": torch.rand(1), "qmap1": torch.linspace(-1, 1, 256)}},
                       1: {"step": 3, nested: {"state1": torch.zeros(4, dtype=torch.uint8)}, "mode": "dynamic"}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1]}]}
    tensors, meta = split_optimizer_state(state)
    assert "state.0.__bnb_optimizer_quant_state__.state1" in tensors
    save_file(tensors, str(tmp_path / "o.safetensors"))
    (tmp_path / "o.json").write_text(json.dumps(meta))
    back = join_optimizer_state(load_file(str(tmp_path / "o.safetensors")), json.loads((tmp_path / "o.json").read_text()))
    assert back["param_groups"] == state["param_groups"]
    for pid, entry in state["state"].items():
        assert back["state"][pid].keys() == entry.keys()
        assert back["state"][pid]["step"] == 3 and back["state"][pid][nested].keys() == entry[nested].keys()
        for k, v in entry[nested].items():
            got = back["state"][pid][nested][k]
            assert got.dtype == v.dtype and torch.equal(got, v), k
    assert back["state"][1]["mode"] == "dynamic"
    with pytest.raises(TypeError, match=r"0\.deep\.a: cannot store a dict"):
        split_optimizer_state({"state": {0: {"deep": {"a": {"b": torch.zeros(1)}}}}, "param_groups": []})


def test_a_loaded_optimizer_keeps_the_learning_rate_it_was_built_with(tmp_path):
    """`--resume --set learner.lr=...` changes the rate from the checkpoint on: the moments are the
    saved ones, the rate the config's (no schedule moves it)."""
    from nla_grpo.shared.fileio import load_optimizer, save_optimizer

    params, opt = _trained_adamw()
    save_optimizer(tmp_path, opt, ["a", "b"], "o.safetensors", "o.json")
    again = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=5e-4, betas=(0.9, 0.95), weight_decay=0.0)
    load_optimizer(tmp_path, again, ["a", "b"], "o.safetensors", "o.json")
    assert again.param_groups[0]["lr"] == 5e-4 and opt.param_groups[0]["lr"] == 1e-3
    for p, q in zip(opt.state.values(), again.state.values()):
        assert torch.equal(p["exp_avg_sq"], q["exp_avg_sq"]) and torch.equal(p["step"], q["step"])


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


def test_one_optimizer_format_for_learner_and_critic_and_the_critics_older_files_load(tmp_path):
    import json

    from nla_grpo.shared.fileio import load_optimizer, save_optimizer

    _, opt = _trained_adamw()
    save_optimizer(tmp_path / "new", opt, ["a", "b"], "opt.safetensors", "opt.json")
    fresh_params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(4))]
    fresh = torch.optim.AdamW(fresh_params, lr=1.0)
    load_optimizer(tmp_path / "new", fresh, ["a", "b"], "opt.safetensors", "opt.json")
    assert fresh.state_dict()["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(fresh.state_dict()["state"][1]["exp_avg"], opt.state_dict()["state"][1]["exp_avg"])
    with pytest.raises(Exception, match="param_names: do not match the model's trainable tensors"):
        load_optimizer(tmp_path / "new", fresh, ["a", "c"], "opt.safetensors", "opt.json")
    # the critic's earlier layout: scalars under "state_scalars", betas written as a JSON list
    sd = opt.state_dict()
    old = tmp_path / "old"
    old.mkdir()
    save_file({f"state.{i}.{k}": v for i, e in sd["state"].items() for k, v in e.items() if torch.is_tensor(v)},
              str(old / "opt.safetensors"))
    (old / "opt.json").write_text(json.dumps({
        "optimizer": "AdamW", "param_names": ["a", "b"], "param_groups": [dict(g, betas=list(g["betas"])) for g in sd["param_groups"]],
        "state_scalars": {}}))
    again = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(4))], lr=1.0)
    load_optimizer(old, again, ["a", "b"], "opt.safetensors", "opt.json")
    assert again.state_dict()["param_groups"][0]["betas"] == (0.9, 0.95) and again.param_groups[0]["lr"] == 1.0  # the built one


def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path):
    from nla_grpo.shared.fileio import atomic_write, write_json

    target = tmp_path / "meta.json"
    write_json(target, {"a": 1, "t": (1, 2)})
    assert json_load(target) == {"a": 1, "t": [1, 2]}

    def broken(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert json_load(target)["a"] == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]


def json_load(path):
    import json

    return json.loads(path.read_text())


def test_strict_json_lines_and_clear_tensor_file_errors(tmp_path):
    from nla_grpo.shared.errors import NlaInputError
    from nla_grpo.shared.fileio import load_tensors

    assert jsonable({"x": float("inf"), "y": [1.0, float("nan")]}, nonfinite=None) == {"x": None, "y": [1.0, None]}
    kept = jsonable({"x": float("inf")})
    assert kept["x"] == float("inf")
    (tmp_path / "bad.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(NlaInputError, match="not a readable safetensors file"):
        load_tensors(tmp_path / "bad.safetensors")
    with pytest.raises(NlaInputError, match="file not found"):
        load_tensors(tmp_path / "none.safetensors")


def test_a_frozen_critic_record_checks_the_critic_the_run_builds(tmp_path):
    from nla_grpo.critic.checkpoint import META_NAME, WEIGHTS_NAME, check_frozen_record, write_frozen_record

    ar = tmp_path / "ar"
    ar.mkdir()
    (ar / META_NAME).write_text('{"num_layers": 2, "d_model": 4}')
    (ar / WEIGHTS_NAME).write_bytes(b"weights")
    write_frozen_record(tmp_path / "a.json", ar)
    write_frozen_record(tmp_path / "m.json", None)
    check_frozen_record(tmp_path / "a.json", ar)
    moved = tmp_path / "moved"
    ar.rename(moved)  # critic.checkpoint may move: the bytes are what count
    check_frozen_record(tmp_path / "a.json", moved)
    check_frozen_record(tmp_path / "m.json", None)
    with pytest.raises(NlaInputError, match="came from critic.checkpoint, this run builds it from the base model"):
        check_frozen_record(tmp_path / "a.json", None)
    with pytest.raises(NlaInputError, match="came from model, this run builds it from critic.checkpoint"):
        check_frozen_record(tmp_path / "m.json", moved)
    (moved / WEIGHTS_NAME).write_bytes(b"weightz")
    with pytest.raises(NlaInputError, match=r"a.json: critic.checkpoint has changed .*critic_weights.safetensors"):
        check_frozen_record(tmp_path / "a.json", moved)
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(NlaInputError, match="expected a nla-grpo-frozen-critic record"):
        check_frozen_record(tmp_path / "bad.json", None)
