"""The packed adapter buffer: exact round trips in order, aligned, a snapshot, clear errors."""
import pytest
import torch

from nla_grpo.shared.tensor_wire import ALIGN, layout, pack_tensors, unpack_tensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.lora_A.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: forces padding
        "a.lora_B.weight": torch.randn(7, 3, generator=g),
        "b.scalar": torch.tensor(2.5, dtype=torch.float64),
        "c.ids": torch.arange(11, dtype=torch.int64),
        "d.strided": torch.randn(4, 6, generator=g).t(),  # not contiguous
    }


def test_round_trip_is_exact_and_keeps_order():
    src = _tensors()
    entries, buf = pack_tensors(src)
    out = unpack_tensors(entries, buf)
    assert list(out) == list(src)
    for k, t in src.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t), k
    assert all(offset % ALIGN == 0 for _, _, _, offset, _ in entries)
    assert buf.dtype == torch.uint8 and buf.numel() == layout(src)[1]


def test_pack_is_a_snapshot():
    src = _tensors()
    entries, buf = pack_tensors(src)
    before = {k: t.clone() for k, t in src.items()}
    for t in src.values():
        t.add_(1)  # the learner keeps training after an export
    out = unpack_tensors(entries, buf)
    assert all(torch.equal(out[k], before[k]) for k in src)


def test_errors_are_one_line():
    with pytest.raises(TypeError, match="'x': expected a torch.Tensor"):
        pack_tensors({"x": [1.0]})
    entries, buf = pack_tensors(_tensors())
    with pytest.raises(ValueError, match="expected at least .* bytes"):
        unpack_tensors(entries, buf[:-ALIGN])
