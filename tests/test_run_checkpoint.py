"""``orchestrator.checkpoint``: the run checkpoint's state round-trips, and a damaged one is named in one line."""
import json

import pytest

from nla_grpo.orchestrator.checkpoint import STATE_FILE, RunState, checkpoint_problem, is_checkpoint, required_parts
from nla_grpo.shared.errors import NlaInputError


def test_the_state_round_trips_and_an_import_says_where_it_came_from(tmp_path):
    state = RunState(7, {"kind": "shuffled", "cursor": 3}, 8, {"seed": 0}, {"rows": 12})
    state.write(tmp_path)
    assert RunState.read(tmp_path) == state
    assert "imported_from" not in json.loads((tmp_path / STATE_FILE).read_text())
    imported = RunState(7, {}, 8, imported_from="/ref/iter_000007")
    imported.write(tmp_path)
    assert RunState.read(tmp_path) == imported


@pytest.mark.parametrize("change,needle", [
    ({"step": "7"}, "step: expected int, found '7'"),
    ({"step": True}, "step: expected int, found True"),
    ({"order": [1]}, r"order: expected dict, found \[1\]"),
    ({"step": None}, "step: expected int, found None"),
    ({"config": [1]}, "config: expected an object, found list"),
])
def test_a_state_that_is_not_one_is_named_with_its_field(tmp_path, change, needle):
    raw = {"step": 7, "order": {}, "adapter_version": 8, **change}
    (tmp_path / STATE_FILE).write_text(json.dumps(raw))
    with pytest.raises(NlaInputError, match=needle) as err:
        RunState.read(tmp_path)
    assert str(err.value).startswith(str(tmp_path / STATE_FILE))


def test_what_counts_as_a_checkpoint_and_what_it_must_hold(tmp_path):
    ckpt = tmp_path / "step_000004"
    ckpt.mkdir()
    assert not is_checkpoint(ckpt)
    RunState(4, {}, 5).write(ckpt)
    assert is_checkpoint(ckpt) and not is_checkpoint(tmp_path)
    stray = tmp_path / "step_000004.bak"
    stray.mkdir()
    RunState(4, {}, 5).write(stray)
    assert not is_checkpoint(stray)
    parts = required_parts()
    assert checkpoint_problem(ckpt) == f"{parts[1]} is missing"
    (ckpt / parts[1]).parent.mkdir()
    (ckpt / parts[1]).write_text("{}")
    assert checkpoint_problem(ckpt) == f"{' or '.join(parts[2])} is missing"
    (ckpt / parts[2][1]).write_text("{not json")
    assert checkpoint_problem(ckpt).startswith(f"{parts[2][1]} is damaged (JSONDecodeError")
