"""The packed adapter buffer: exact round trips, own storage, clear errors."""
import pickle

import pytest
import torch

from shared.tensor_wire import ALIGN, PackedTensors, as_tensor_dict, pack_tensors, sender_buffer, unpack_tensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.lora_A.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: forces padding
        "a.lora_B.weight": torch.randn(7, 3, generator=g),
        "b.scalar": torch.tensor(2.5, dtype=torch.float64),
        "c.ids": torch.arange(11, dtype=torch.int64),
        "d.strided": torch.randn(4, 6, generator=g).t(),  # not contiguous
    }


def test_host_round_trip_is_exact_and_keeps_order():
    src = _tensors()
    packed = pickle.loads(pickle.dumps(pack_tensors(src, "host")))
    out = unpack_tensors(packed, "cpu")
    assert list(out) == list(src)
    for k, t in src.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t), k
    assert all(offset % ALIGN == 0 for _, _, _, offset, _ in packed.entries)
    assert len(packed) == len(src)


def test_pack_is_a_snapshot_and_unpack_owns_its_storage():
    src = _tensors()
    packed = pack_tensors(src, "host")
    before = {k: t.clone() for k, t in src.items()}
    for t in src.values():
        t.add_(1)  # the learner keeps training after an export
    out = unpack_tensors(packed, "cpu")
    assert all(torch.equal(out[k], before[k]) for k in src)
    out["c.ids"].zero_()  # the receiver may change what it got (vLLM scales lora_B in place)
    assert torch.equal(unpack_tensors(packed, "cpu")["c.ids"], before["c.ids"])


def test_as_tensor_dict_passes_plain_dicts_through():
    src = _tensors()
    assert as_tensor_dict(src, "cpu") is src
    assert torch.equal(as_tensor_dict(pack_tensors(src, "host"), "cpu")["a.lora_B.weight"], src["a.lora_B.weight"])


def test_collective_route_sends_only_the_table_of_contents():
    src = _tensors()
    packed = pack_tensors(src, "collective")
    wire = pickle.loads(pickle.dumps(packed))
    assert wire.payload is None and not hasattr(wire, "_keepalive") and len(pickle.dumps(packed)) < 2000
    sent = sender_buffer(packed)
    out = unpack_tensors(wire, "cpu", receive=lambda buf: buf.copy_(sent))  # what the broadcast does
    assert all(torch.equal(out[k], src[k]) for k in src)
    with pytest.raises(ValueError, match="needs a channel"):
        unpack_tensors(wire, "cpu")
    with pytest.raises(ValueError, match="no sender buffer"):
        sender_buffer(wire)


def test_errors_are_one_line():
    with pytest.raises(ValueError, match="expected one of"):
        pack_tensors(_tensors(), "nccl")
    with pytest.raises(ValueError, match="cuda_ipc needs CUDA tensors"):
        pack_tensors(_tensors(), "cuda_ipc")
    with pytest.raises(TypeError, match="'x': expected a torch.Tensor"):
        pack_tensors({"x": [1.0]}, "host")
    bad = pack_tensors(_tensors(), "host")
    bad.payload = bad.payload[:-ALIGN]
    with pytest.raises(ValueError, match="bytes"):
        unpack_tensors(bad, "cpu")


def test_ray_carries_the_buffer_out_of_band(ray_local):
    import numpy as np
    import ray

    src = _tensors()
    got = ray.get(ray.put(pack_tensors(src, "host")))
    assert isinstance(got, PackedTensors) and isinstance(got.payload, np.ndarray)
    assert not got.payload.flags.writeable  # read in place from the object store, not unpickled
    out = unpack_tensors(got, "cpu")
    assert all(torch.equal(out[k], src[k]) for k in src)
