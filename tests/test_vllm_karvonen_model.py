"""The karvonen model class's maths without vLLM: the sentinel carries the vector, the dense forward
restores the marker before block 0 and adds ||h||·v/||v|| to the stream after block L."""
import types

import pytest
import torch

from nla_grpo.rollout.vllm.karvonen import SENTINEL_NORM, _forward, find_sites, hf_overrides, mark_site, sentinel_row
from nla_grpo.shared.injection import karvonen_delta


class Block(torch.nn.Module):
    """vLLM's decoder-block contract: (positions, hidden, residual) -> (hidden, residual), stream = sum."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, positions, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return torch.tanh(self.lin(residual)), residual


def _fake_model(d, n_layers, layer, marker_id, vocab=16):
    emb = torch.nn.Embedding(vocab, d)
    m = types.SimpleNamespace(layers=torch.nn.ModuleList([Block(d) for _ in range(n_layers)]), start_layer=0,
                              end_layer=n_layers, nla_layer=layer, nla_marker_ids=torch.tensor([marker_id]),
                              embed_input_ids=emb, norm=lambda h, r: (h + r, None))
    return m, emb


def test_the_sentinel_carries_the_direction_far_above_any_embedding():
    v = torch.randn(64) * 3
    row = sentinel_row(v)
    assert torch.linalg.vector_norm(row) == pytest.approx(SENTINEL_NORM, rel=1e-6)
    assert torch.allclose(row / SENTINEL_NORM, v / v.norm(), atol=1e-7)
    for bad in (torch.zeros(64), torch.full((64,), float("nan"))):
        with pytest.raises(ValueError, match="finite and non-zero"):
            sentinel_row(bad)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        embeds = (torch.randn(10, 64) * 2).to(dtype)  # token embeddings: norms ~16, far below 2^13
        sites, norms = find_sites(mark_site(embeds, 4, v))
        assert sites.squeeze(1).tolist() == [i == 4 for i in range(10)]
        assert norms[4].item() == pytest.approx(SENTINEL_NORM, rel=1e-2)


def test_the_dense_forward_restores_the_marker_and_injects_norm_matched_into_the_stream():
    torch.manual_seed(1)
    d, layer, marker_id = 8, 1, 3
    model, emb = _fake_model(d, 3, layer, marker_id)
    ids = [torch.tensor([1, marker_id, 5, 7]), torch.tensor([2, 2, 9, marker_id, 4])]
    sites, vectors = [1, 3], torch.randn(2, d)
    with torch.no_grad():
        plain = torch.cat([emb(x) for x in ids])
        # the expectation, by hand: the token-id prompt, +||h||·v/||v|| on the stream after block `layer`
        hidden, residual = plain, None
        for i, blk in enumerate(model.layers):
            hidden, residual = blk(None, hidden, residual)
            if i == layer:
                stream = hidden + residual
                for row, v in zip([1, 4 + 3], vectors):
                    stream[row] += karvonen_delta(stream[row], v)
                hidden = stream - residual
        expected = hidden + residual
        marked = torch.cat([mark_site(emb(x), s, v) for x, s, v in zip(ids, sites, vectors)])
        got = _forward(model, None, None, inputs_embeds=marked)
        assert torch.allclose(got, expected, atol=1e-5)
        # no sentinel (decode steps, inject=False) and token ids: the plain forward
        assert torch.allclose(_forward(model, None, None, inputs_embeds=plain), _forward(model, torch.cat(ids), None), atol=1e-6)
        assert not torch.allclose(_forward(model, None, None, inputs_embeds=plain), expected, atol=1e-3)


def test_overrides_select_the_injecting_class_and_refuse_other_architectures():
    assert hf_overrides("Qwen3ForCausalLM", 1, 42) == {"architectures": ["NlaKarvonenQwen3ForCausalLM"],
                                                       "nla_karvonen_layer": 1, "nla_marker_id": 42}
    with pytest.raises(ValueError, match="expected a model of Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM"):
        hf_overrides("MistralForCausalLM", 1, 42)


def test_the_plugin_is_installed_and_never_raises(monkeypatch, caplog):
    pytest.importorskip("vllm")
    import sys

    from nla_grpo.rollout.vllm.plugin import register, registered

    assert registered()  # the package's entry point is what vLLM loads in each of its processes
    monkeypatch.setitem(sys.modules, "nla_grpo.rollout.vllm.karvonen", None)  # importing it now fails
    with caplog.at_level("WARNING"):
        register()  # an error here would stop every vLLM engine in the environment
    assert "karvonen and marker-input model classes are not registered (ModuleNotFoundError" in caplog.text
