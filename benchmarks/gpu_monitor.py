"""What the GPU reported while a benchmark ran: memory in use, SM clock, power, polled with nvidia-smi.

The poll runs outside the measured code (a child process read by a thread), so the benchmark holds no extra
CUDA context and the GPU does no extra work. A sustained load can lower the SM clock (the board's power
cap); a GEMM peak timed in short bursts then overstates what a ten-second update can reach, and the SM
clock seen during each variant tells whether that happened.
"""
from __future__ import annotations

import math
import statistics
import subprocess
import threading
import time

FIELDS = ("memory.used", "clocks.sm", "power.draw")  # MiB, MHz, W


class SmiPoll:
    """``with SmiPoll() as p: ...``; then ``p.summary()``. One row per GPU per poll; ``command`` replaces
    nvidia-smi (tests). Without nvidia-smi every figure is NaN."""

    def __init__(self, fields=FIELDS, interval_ms: int = 250, command: list[str] | None = None):
        self.fields = tuple(fields)
        self.command = command or ["nvidia-smi", f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits",
                                   "-lms", str(interval_ms)]
        self.rows: list[tuple[float, ...]] = []
        self.times: list[float] = []  # unix time each row was read (within a poll interval of its reading)
        self.proc = None

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != len(self.fields):
                continue
            try:
                row = tuple(float(p) for p in parts)
            except ValueError:  # "[N/A]" and the like
                continue
            self.times.append(time.time())
            self.rows.append(row)

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.thread.join(timeout=5)
        return False

    def values(self, field: str) -> list[float]:
        i = self.fields.index(field)
        return [r[i] for r in self.rows]

    def summary(self) -> dict:
        """Per field: median, min and max over the polls (NaN when none came)."""
        out = {}
        for f in self.fields:
            v = self.values(f)
            out[f] = ({"median": statistics.median(v), "min": min(v), "max": max(v)} if v
                      else dict.fromkeys(("median", "min", "max"), math.nan))
        return out


def peak_by_phase(times: list[float], values: list[float], timeline: list[dict]) -> dict:
    """The largest value polled inside each phase's windows (``timeline.jsonl`` rows: ``{"step", "phases":
    [[name, start, end], ...]}``), over all the rows given; a phase no poll fell in is left out."""
    out: dict[str, float] = {}
    for row in timeline:
        for name, start, end in row["phases"]:
            inside = [v for t, v in zip(times, values) if start <= t <= end]
            if inside:
                out[name] = max(out.get(name, -math.inf), max(inside))
    return out


APP_FIELDS = ("pid", "used_memory")  # nvidia-smi --query-compute-apps: one row per process on the GPU, MiB


def app_poll(interval_ms: int = 250) -> SmiPoll:
    """An ``SmiPoll`` of the GPU's processes: each poll prints one row per process, read together."""
    return SmiPoll(APP_FIELDS, command=["nvidia-smi", f"--query-compute-apps={','.join(APP_FIELDS)}",
                                        "--format=csv,noheader,nounits", "-lms", str(interval_ms)])


def peak_by_phase_per_process(times: list[float], rows: list[tuple[float, ...]], timeline: list[dict],
                              labels: dict[int, str], gap: float = 0.1) -> dict[str, dict[str, float]]:
    """Per phase, per service: the most its processes held at once in one poll (MiB). ``rows``: ``(pid, MiB)`` as
    ``app_poll`` read them (a poll's rows come together; a pause over ``gap`` seconds starts the next poll);
    ``labels``: pid -> service name, every other process counted as ``"other"``."""
    polls: list[tuple[float, dict[str, float]]] = []
    last = -math.inf
    for t, (pid, mib) in zip(times, rows):
        if t - last > gap:
            polls.append((t, {}))
        last = t
        held = polls[-1][1]
        name = labels.get(int(pid), "other")
        held[name] = held.get(name, 0.0) + mib
    out: dict[str, dict[str, float]] = {}
    for row in timeline:
        for phase, start, end in row["phases"]:
            for t, held in polls:
                if start <= t <= end:
                    peaks = out.setdefault(phase, {})
                    for name, mib in held.items():
                        peaks[name] = max(peaks.get(name, 0.0), mib)
    return out
