"""The karvonen sentinel scheme for vLLM on a flat vLLM-style block stack (pure torch, no engine)."""
import pytest
import torch

from rollout.vllm_karvonen import KarvonenSites, find_sites, mark_site
from shared.injection import karvonen_delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sentinel_round_trip_in_every_dtype(dtype):
    torch.manual_seed(0)
    embeds = torch.randn(6, 16).to(dtype)
    flat, expect = [], []
    for i, (site, index) in enumerate([(2, 0), (0, 255), (5, 256), (3, 65535)]):
        marked = mark_site(embeds, site, index)
        assert torch.equal(marked[[r for r in range(6) if r != site]], embeds[[r for r in range(6) if r != site]])
        flat.append(marked)
        expect.append((6 * i + site, index))
    rows, index = find_sites(torch.cat(flat))
    assert list(zip(rows.tolist(), index.tolist())) == expect
    assert find_sites(embeds)[0].numel() == 0
    with pytest.raises(ValueError, match="at most"):
        mark_site(embeds, 0, 65536)


class Block(torch.nn.Module):
    """vLLM's decoder-block contract: (positions, hidden, residual) -> (hidden, residual), stream = sum."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, positions, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return torch.tanh(self.lin(residual)), residual


def run(layers, hidden, hooks=True):
    residual = None
    for layer in layers:
        hidden, residual = (layer if hooks else layer.forward)(None, hidden, residual)
    return hidden + residual


def test_hooks_restore_the_marker_and_inject_norm_matched_into_the_stream():
    torch.manual_seed(1)
    d, layer = 8, 1
    layers = torch.nn.ModuleList([Block(d) for _ in range(3)])
    marker = torch.randn(d)
    prompts = [torch.randn(4, d), torch.randn(5, d)]
    sites, vectors = [1, 3], torch.randn(2, d)
    for p, s in zip(prompts, sites):
        p[s] = marker
    plain = torch.cat(prompts)
    # the expectation, by hand: the token-id prompt, +||h||·v/||v|| on the stream after block `layer`
    with torch.no_grad():
        hidden, residual = plain, None
        for i, blk in enumerate(layers):
            hidden, residual = blk(None, hidden, residual)
            if i == layer:
                stream = hidden + residual
                for row, v in zip([1, 4 + 3], vectors):
                    stream[row] += karvonen_delta(stream[row], v)
                hidden, residual = stream - residual, residual
        expected = hidden + residual

    hooks = KarvonenSites(layers, layer, marker)
    marked = torch.cat([mark_site(p, s, i) for i, (p, s) in enumerate(zip(prompts, sites))])
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="0 vectors are armed"):
            run(layers, marked)
        hooks.arm(vectors)
        got = run(layers, marked)
        assert torch.allclose(got, expected, atol=1e-6)
        assert hooks.pending is None
        # a forward without sentinel rows (decode, or inject=False) is left alone
        assert torch.equal(run(layers, plain), run(layers, plain, hooks=False))
        assert not torch.allclose(run(layers, plain), expected, atol=1e-3)
        hooks.remove()
        assert torch.equal(run(layers, marked), run(layers, marked, hooks=False))
