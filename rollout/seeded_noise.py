"""Sampling noise for every seeded request of a batch at once, keyed on each request's seed and step.

Every rollout request carries its own seed (a row's samples depend only on the run's seed and the
row). vLLM 0.26 samples such requests by drawing each row's exponential noise with the request's
``torch.Generator``: one kernel launch per request per decode step. At 1,024 running samples that loop
took most of a decode step.

Here a seeded row's noise is a counter-based hash of (row key, vocabulary index), for all rows in one
kernel. The row key mixes the request's seed with its generator's position, which vLLM moves by
``OFFSET_STEP`` per sampled token and moves back when it discards one. So a sample still depends on its
own seed and step only, never on the batch around it, and a discarded draw is drawn again the same.

The hash is 32-bit integer mixing (multiplier ``0x45d9f3b``) kept inside int64, so the torch function
(CPU, tests) and the Triton kernel (GPU) compute the same integers; ``w`` uniform on (0, 1) becomes
``-log1p(-w)``, an Exp(1) draw that keeps full float32 resolution near 0, where the winning token's
noise lies (the sample is ``argmax(p / q)``).
"""
from __future__ import annotations

MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a 32-bit value times it stays inside int64
_SALT_LO, _SALT_HI = 0x68E31DA4, 0x1B56C4E9
OFFSET_STEP = 4  # how far a vLLM request generator's Philox offset moves per sampled token


def _h32(x):
    """A 32-bit integer hash (bijective on [0, 2**32)); works on ints, torch and Triton int64 values."""
    x = (((x >> 16) ^ x) * _MUL) & MASK32
    x = (((x >> 16) ^ x) * _MUL) & MASK32
    return (x >> 16) ^ x


def _row_halves(seed, pos):
    """The two 32-bit halves of a row's key from its seed (any int64) and position."""
    lo = _h32((seed & MASK32) ^ _h32((pos & MASK32) ^ _SALT_LO))
    hi = _h32(((seed >> 32) & MASK32) ^ _h32(lo ^ _SALT_HI))
    return lo, hi


def _bits(lo, hi, v):
    return _h32(_h32(_h32(v ^ lo) ^ hi) ^ v)


def exponential_noise_reference(seeds, positions, vocab: int):
    """``q[i, v]`` ~ Exp(1) for rows (``seeds[i]``, ``positions[i]``), int64 tensors; float32 ``[B, vocab]``."""
    import torch

    lo, hi = _row_halves(seeds[:, None], positions[:, None])
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    w = (_bits(lo, hi, v).to(torch.float32) + 0.5) * 2.0 ** -32
    return -torch.log1p(-w)


def exponential_noise(seeds, positions, vocab: int):
    """``exponential_noise_reference``'s values: one Triton kernel on a CUDA device, torch elsewhere."""
    if seeds.device.type == "cuda":
        kernel = _triton_kernel()
        if kernel is not None:
            import torch

            out = torch.empty((seeds.shape[0], vocab), device=seeds.device, dtype=torch.float32)
            block = 4096
            kernel[(seeds.shape[0], (vocab + block - 1) // block)](out, out.stride(0), seeds, positions, vocab,
                                                                    BLOCK=block)
            return out
    return exponential_noise_reference(seeds, positions, vocab)


_KERNEL = []


def _triton_kernel():
    if not _KERNEL:
        try:
            _KERNEL.append(_build_kernel())
        except Exception:  # noqa: BLE001 - no Triton: the torch function computes the same values
            _KERNEL.append(None)
    return _KERNEL[0]


def _build_kernel():
    import triton
    import triton.language as tl

    try:
        from triton.language.extra.cuda.libdevice import log1p
    except ImportError:  # older Triton
        from triton.language.math import log1p

    @triton.jit
    def h32(x):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        return (x >> 16) ^ x

    @triton.jit
    def noise(out_ptr, out_stride, seeds_ptr, pos_ptr, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        seed = tl.load(seeds_ptr + row).to(tl.int64)
        pos = tl.load(pos_ptr + row).to(tl.int64)
        lo = h32((seed & 0xFFFFFFFF) ^ h32((pos & 0xFFFFFFFF) ^ 0x68E31DA4))
        hi = h32(((seed >> 32) & 0xFFFFFFFF) ^ h32(lo ^ 0x1B56C4E9))
        v = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        bits = h32(h32(h32(v ^ lo) ^ hi) ^ v)
        w = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10
        tl.store(out_ptr + row * out_stride + v, -log1p(-w), mask=v < vocab)

    return noise


def generator_positions(generators: dict) -> tuple[list[int], list[int], list[int]]:
    """Rows, seeds and positions of vLLM's per-request generators, each moved on by one draw.

    CUDA generators report their Philox offset (moved by ``OFFSET_STEP``, so vLLM's rewind of a
    discarded token lands on the same position again); a CPU generator has no offset, so one draw
    from it is its position. One pass per field: at 1,024 rows about a third faster on a GPU host than one loop
    doing all three (``benchmarks/seeded_sampler_host.py``).
    The rows of one batch share a device."""
    import torch

    rows = sorted(generators)
    gens = [generators[row] for row in rows]
    seeds = [s - 2 ** 64 if s >= 2 ** 63 else s for s in (g.initial_seed() for g in gens)]  # unsigned 64-bit: as int64
    if gens and gens[0].device.type == "cpu":
        positions = [int(torch.randint(0, 2 ** 31, (1,), generator=g).item()) for g in gens]
    else:
        positions = [g.get_offset() for g in gens]
        for g, offset in zip(gens, positions):
            g.set_offset(offset + OFFSET_STEP)
    return rows, seeds, positions


def seeded_noise_like(probs, generators: dict):
    """The noise ``q`` vLLM's ``random_sample`` needs for ``probs[B, V]``: seeded rows from their keys,
    the others from the device's default generator (as vLLM draws them)."""
    import torch

    rows, seeds, positions = generator_positions(generators)
    device = probs.device
    pin = device.type == "cuda"  # a pinned copy goes without waiting for the queued forward pass

    def on_device(values):
        return torch.tensor(values, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=pin)

    noise = exponential_noise(on_device(seeds), on_device(positions), probs.shape[-1])
    if rows == list(range(probs.shape[0])):
        return noise
    q = torch.empty_like(probs, dtype=torch.float32)
    q.exponential_()
    q.index_copy_(0, on_device(rows), noise)
    return q
