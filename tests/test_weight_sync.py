"""The weight-sync contract: every ``weight_sync`` variant, driven by the controller's one call
(``orchestrator.weight_push.AdapterPush``) between real processes, delivers the learner's exact
adapter to every engine, on the engine's device, in storage of its own, version after version; a
failed export reaches no engine and leaves the next push working. On the CPU (gloo broadcast) and on
GPUs (CUDA IPC, NCCL broadcast)."""
import pickle

import pytest
import torch

from nla_grpo.learner.actor import LearnerActor
from nla_grpo.rollout.actor import RolloutActor
from nla_grpo.rollout.vllm.adapter_registry import check_update
from nla_grpo.shared.config import BroadcastSync, CudaIpcSync, FileSync, HostSync
from nla_grpo.shared.types import AdapterUpdate
from nla_grpo.shared.weight_sync import make_receiver, make_sender

SETTINGS = {"host": HostSync(), "file": FileSync(), "cuda_ipc": CudaIpcSync(), "broadcast": BroadcastSync(timeout_s=60.0)}
PEFT = {"r": 4, "lora_alpha": 8, "peft_type": "LORA"}


def _adapter(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"layers.0.q.lora_A.weight": torch.randn(4, 33, generator=g).to(torch.bfloat16).to(device),
            "layers.0.q.lora_B.weight": torch.randn(17, 4, generator=g).to(device),
            "layers.1.o.lora_B.weight": torch.randn(5, 4, generator=g).t().to(device)}  # not contiguous


class StandInLearner:
    """What ``LearnerActor`` asks of its ``Learner``: the live adapter and its version."""

    def __init__(self, device):
        self.tensors, self.version, self.fail = _adapter(device), 1, False

    def export_adapter(self, device="cpu"):
        assert device == "live"
        if self.fail:
            raise RuntimeError("export failed on purpose")
        return AdapterUpdate(self.version, dict(self.tensors), PEFT)


class SyncLearner(LearnerActor):
    """The real actor's weight-sync methods over a stand-in learner."""

    def __init__(self, kind, device):
        self.learner = StandInLearner(device)
        self.sender = make_sender(SETTINGS[kind], device)

    def train(self, fail_next_export=False):
        for t in self.learner.tensors.values():
            t.mul_(0.5).add_(1.0)  # in place: as an optimiser step changes the live weights
        self.learner.version += 1
        self.learner.fail = fail_next_export

    def expected(self):
        return {k: t.cpu() for k, t in self.learner.tensors.items()}

    def holds_export(self) -> bool:
        return self.sender._buffer is not None

    def message_bytes(self):
        """Pickled size of an export (what Ray carries besides any out-of-band buffer) and the adapter's size."""
        message = self.export_adapter()
        return len(pickle.dumps(message)), sum(t.numel() * t.element_size() for t in self.learner.tensors.values())


class RecordingEngine:
    def __init__(self, device):
        self.device, self.adapter_version, self.updates = device, 0, []

    def load_adapter(self, update):
        check_update(update, self.adapter_version)
        self.updates.append(update)
        self.adapter_version = update.version


class SyncEngine(RolloutActor):
    """The real actor's weight-sync methods over an engine that records what it got."""

    def __init__(self, kind, device):
        self.engine = RecordingEngine(device)
        self.receiver = make_receiver(SETTINGS[kind])

    def received(self):
        """Per version: name -> (device type, CPU copy)."""
        out = []
        for u in self.engine.updates:
            out.append((u.version, u.peft_config, {k: (t.device.type, t.cpu().clone()) for k, t in u.tensors.items()}))
            for t in u.tensors.values():
                t.mul_(-1.0)  # an engine may change what it got in place (vLLM scales lora_B)
        return out


CASES = [("cpu", "host"), ("cpu", "file"), ("cpu", "broadcast"),
         ("cuda", "host"), ("cuda", "file"), ("cuda", "cuda_ipc"), ("cuda", "broadcast")]


def _skip(device, kind):
    gpus = torch.cuda.device_count()
    if device == "cpu" and kind == "cuda_ipc":
        pytest.skip("CUDA IPC needs a GPU")
    if device == "cuda" and not gpus:
        pytest.skip("needs a CUDA GPU")
    if device == "cuda" and kind == "broadcast" and gpus < 2:
        pytest.skip("NCCL needs a GPU per member")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device,kind", CASES, ids=[f"{d}-{k}" for d, k in CASES])
def test_every_variant_delivers_each_version_exactly(ray_local, device, kind):
    from nla_grpo.orchestrator.weight_push import AdapterPush

    _skip(device, kind)
    ray = ray_local
    engines_n = 2 if not (device == "cuda" and kind == "broadcast") else min(2, torch.cuda.device_count() - 1)
    # a GPU each for NCCL; otherwise every member shares one GPU (what colocated placement does)
    gpu = (1 if kind == "broadcast" else 1 / (engines_n + 1)) if device == "cuda" else 0
    learner = ray.remote(SyncLearner).options(num_cpus=0, num_gpus=gpu).remote(kind, device)
    engines = [ray.remote(SyncEngine).options(num_cpus=0, num_gpus=gpu).remote(kind, device) for _ in range(engines_n)]
    push = AdapterPush(learner, engines)
    expected = {}
    for version in (1, 2):
        assert push() == version
        assert not ray.get(learner.holds_export.remote())  # every engine has its copy: the learner's buffer went
        expected[version] = ray.get(learner.expected.remote())
        ray.get(learner.train.remote())
    ray.get(learner.train.remote(fail_next_export=True))  # v4's export fails
    with pytest.raises(Exception, match="export failed on purpose"):
        push()
    ray.get(learner.train.remote())
    assert push() == 5  # nothing half-sent: the channel still lines up
    expected[5] = ray.get(learner.expected.remote())
    for e in engines:  # one after the other: each negates its copies after reporting them
        got = ray.get(e.received.remote())
        assert [v for v, _, _ in got] == [1, 2, 5]
        for version, config, tensors in got:
            assert config == PEFT and list(tensors) == list(expected[version])
            for name, (where, t) in tensors.items():
                want = expected[version][name]
                assert where == device and t.dtype == want.dtype and t.shape == want.shape, name
                assert torch.equal(t, want), (version, name)
    # an engine's in-place changes reached neither the other engine (above) nor the learner
    assert all(torch.equal(t, expected[5][k]) for k, t in ray.get(learner.expected.remote()).items())
    for e in engines:
        again = ray.get(e.received.remote())  # negated once by the previous call: negate back to compare
        assert all(torch.equal(-t, expected[v][k]) for v, _, ts in again for k, (_, t) in ts.items())
    wire, adapter = ray.get(learner.message_bytes.remote())
    if kind in ("cuda_ipc", "broadcast"):
        assert wire < 10_000  # a handle or a table of contents, not the data
    else:
        assert wire > adapter
    for a in [learner, *engines]:
        ray.kill(a)


def test_host_receiver_copies_out_of_the_message():
    sender, receiver = make_sender("host"), make_receiver("host")
    src = _adapter("cpu")
    message = pickle.loads(pickle.dumps(sender.export(AdapterUpdate(1, src, PEFT))))
    first = receiver.receive(message, "cpu")
    for t in first.tensors.values():
        t.zero_()
    second = receiver.receive(message, "cpu")
    assert all(torch.equal(second.tensors[k], src[k]) for k in src)


def test_broadcast_message_is_only_the_table_of_contents():
    sender = make_sender(SETTINGS["broadcast"])
    message = sender.export(AdapterUpdate(3, _adapter("cpu"), PEFT))
    blob = pickle.dumps(message)
    assert message.payload is None and len(blob) < 2000
    with pytest.raises(RuntimeError, match="not connected"):
        make_receiver(SETTINGS["broadcast"]).receive(pickle.loads(blob), "cpu")
    stale = pickle.loads(blob)
    stale.version = 2
    with pytest.raises(RuntimeError, match="v2 is not the latest export"):
        sender.send(stale)


def test_sync_errors_are_one_line():
    with pytest.raises(ValueError, match="has no tensors"):
        make_sender("host").export(AdapterUpdate(1, {}, PEFT))
    with pytest.raises(ValueError, match="cuda_ipc needs the adapter on a CUDA device"):
        make_sender("cuda_ipc").export(AdapterUpdate(1, _adapter("cpu"), PEFT))
    message = make_sender("host").export(AdapterUpdate(1, _adapter("cpu"), PEFT))
    with pytest.raises(ValueError, match="a 'host' message reached a 'broadcast' receiver"):
        make_receiver("broadcast").receive(message, "cpu")
    message.payload = message.payload[:-64]
    with pytest.raises(ValueError, match="expected .* bytes, found"):
        make_receiver("host").receive(message, "cpu")
    with pytest.raises(ValueError, match="weight_sync.kind: expected one of host, cuda_ipc, broadcast, file, found 'auto'"):
        make_sender("auto")


def test_ray_carries_the_host_buffer_out_of_band(ray_local):
    import numpy as np

    src = _adapter("cpu")
    got = ray_local.get(ray_local.put(make_sender("host").export(AdapterUpdate(1, src, PEFT))))
    assert isinstance(got.payload, np.ndarray) and not got.payload.flags.writeable  # read in place from the store
    out = make_receiver("host").receive(got, "cpu")
    assert all(torch.equal(out.tensors[k], src[k]) for k in src)


def test_only_a_handle_goes_on_to_another_process():
    """Which messages an engine core in its own process may open itself: the cuda_ipc handle, no other variant's."""
    from nla_grpo.shared.weight_sync import AdapterMessage, VARIANTS, forwardable, make_receiver

    assert {kind for kind in VARIANTS if forwardable(AdapterMessage(kind, 1, {}, [], 0))} == {"cuda_ipc"}
    assert make_receiver("cuda_ipc").forwardable and not make_receiver("host").forwardable
    assert not forwardable(AdapterMessage("carrier-pigeon", 1, {}, [], 0))
