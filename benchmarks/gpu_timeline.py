"""How busy the GPU was in a profiled stretch, and what the host was doing while it sat idle.

A kernel table (``prof.key_averages()``) sums the time kernels ran; it cannot show the time no kernel ran.
When the host falls behind (a sync that drains the queue, Python between micro-batches, a stretch of
kernels shorter than their launches), the GPU idles and the wall time exceeds the kernels' sum. Here:

- ``busy``: the union of the device's activity intervals (kernels, copies, memsets) over the window;
- ``gaps``: the idle stretches, longest first, each with the host ops that overlapped it most (the
  outermost ops of each host thread: what the Python code had called) and the device activity that ended it;
- ``idle_by_op``: the idle time summed per outermost host op name (an idle stretch counts for every op it
  overlapped, in proportion), which names the syncs and the host work to move or cut.

- ``device_time_by_kind``: the device's time summed per kind of kernel (matmul, attention, sampling, copy,
  elementwise), so a step's time can be set against what its matmuls and its KV reads need at the peak rates.

Pure functions over ``Span`` lists; ``spans_from_profiler`` reads them from a ``torch.profiler.profile``.
"""
from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # microseconds
    end: float


def merge(spans: list[Span]) -> list[tuple[float, float]]:
    """The union of the spans' intervals, as sorted disjoint (start, end) pairs."""
    out: list[list[float]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], s.end)
        else:
            out.append([s.start, s.end])
    return [(a, b) for a, b in out]


def idle_gaps(device: list[Span], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The stretches of ``window`` in which no device span ran."""
    lo, hi = window
    gaps, t = [], lo
    for a, b in merge(device):
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if a > t:
            gaps.append((t, a))
        t = max(t, b)
    if hi > t:
        gaps.append((t, hi))
    return gaps


def _overlaps(gaps: list[tuple[float, float]], host: list[Span]) -> list[list[tuple[str, float]]]:
    """Per gap (gaps in time order, disjoint): (host op name, overlap) of each host span that overlaps it. One
    sweep over both in time order: a trace of a whole update holds 10^5 host spans and 10^4 gaps."""
    spans = sorted(host, key=lambda s: s.start)
    out, active, j = [], [], 0
    for a, b in gaps:
        while j < len(spans) and spans[j].start < b:
            active.append(spans[j])
            j += 1
        active = [s for s in active if s.end > a]  # later gaps start later still: a span ended here is done
        out.append([(s.name, min(b, s.end) - max(a, s.start)) for s in active if s.start < b])
    return out


def timeline_report(device: list[Span], host: list[Span], window: tuple[float, float] | None = None,
                    top: int = 12, min_gap_us: float = 50.0) -> dict:
    """Busy share, the longest idle gaps and the idle time per host op (``host``: outermost host ops)."""
    if window is None:
        every = device + host
        if not every:
            return {"window_ms": 0.0, "busy_ms": 0.0, "busy": 0.0, "idle_ms": 0.0, "gaps": [], "idle_by_op": {}}
        window = (min(s.start for s in every), max(s.end for s in every))
    length = window[1] - window[0]
    gaps = idle_gaps(device, window)
    idle = sum(b - a for a, b in gaps)
    by_op: dict[str, float] = defaultdict(float)
    listed = []
    starts = sorted(device, key=lambda s: s.start)
    start_times = [s.start for s in starts]
    overlaps = _overlaps(gaps, host)
    for k in sorted(range(len(gaps)), key=lambda k: gaps[k][0] - gaps[k][1]):  # longest first
        (a, b), over = gaps[k], overlaps[k]
        total = sum(o for _, o in over)
        for name, o in over:  # the gap shared among the host ops that overlapped it
            by_op[name] += (b - a) * o / total
        if not over:
            by_op["(no host op)"] += b - a
        if len(listed) < top and b - a >= min_gap_us:
            i = bisect.bisect_left(start_times, b)
            merged: dict[str, float] = defaultdict(float)
            for name, o in over:
                merged[name] += o
            listed.append({"at_ms": (a - window[0]) / 1e3, "ms": (b - a) / 1e3,
                           "host_ops": [n for n, _ in sorted(merged.items(), key=lambda x: -x[1])[:4]],
                           "ended_by": starts[i].name if i < len(starts) else None})
    return {"window_ms": length / 1e3, "busy_ms": (length - idle) / 1e3, "busy": (length - idle) / length if length else 0.0,
            "idle_ms": idle / 1e3, "gaps": listed,
            "idle_by_op": {k: round(v / 1e3, 3) for k, v in sorted(by_op.items(), key=lambda x: -x[1])[:top]}}


def spans_from_profiler(prof) -> tuple[list[Span], list[Span]]:
    """(device spans, outermost host op spans) of a finished ``torch.profiler.profile``."""
    from torch.autograd import DeviceType

    device, host = [], []
    for e in prof.events():
        span = Span(e.name, float(e.time_range.start), float(e.time_range.end))
        if e.device_type == DeviceType.CUDA:
            device.append(span)
        elif e.device_type == DeviceType.CPU and e.cpu_parent is None and span.end > span.start:
            host.append(span)
    return device, host


def format_report(rep: dict) -> str:
    lines = [f"GPU busy {rep['busy']:.1%} of {rep['window_ms']:.1f} ms (idle {rep['idle_ms']:.1f} ms)",
             "idle ms by the outermost host op that overlapped it:"]
    lines += [f"  {v:9.3f}  {k}" for k, v in rep["idle_by_op"].items()]
    lines.append("longest idle gaps:")
    lines += [f"  at {g['at_ms']:9.3f} ms  {g['ms']:7.3f} ms  host: {', '.join(g['host_ops']) or '-'}  then: {g['ended_by']}"
              for g in rep["gaps"]]
    return "\n".join(lines)


# kernel names by kind, first match wins (cuBLAS/CUTLASS/nvjet GEMMs, flash-attention and vLLM's paged kernels,
# the sampler's softmax/exponential/argmax and this project's seeded-noise kernel, copies and fills)
KINDS = (
    ("attention", r"flash|fmha|attn|paged|reshape_and_cache|merge_attn"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|cublas|matmul|splitk|wgmma|sm90_"),
    ("sampling", r"softmax|exponential|argmax|argsort|topk|top_k|gather|noise|sample|cumsum|log_softmax"),
    ("copy", r"memcpy|memset|copy|cat_|fill"),
)


def kernel_kind(name: str) -> str:
    """``matmul``, ``attention``, ``sampling``, ``copy`` or ``elementwise`` (norms, activations, rotary, adds)."""
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "elementwise"


def device_time_by_kind(device: list[Span], top: int = 12) -> dict:
    """Milliseconds of device time per kind of kernel (``kernel_kind``), and the ``top`` kernels by time."""
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for s in device:
        by_kind[kernel_kind(s.name)] += s.end - s.start
        by_name[s.name] += s.end - s.start
    return {"ms": {k: round(v / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda x: -x[1])},
            "top_kernels_ms": {k[:120]: round(v / 1e3, 3) for k, v in sorted(by_name.items(), key=lambda x: -x[1])[:top]}}
