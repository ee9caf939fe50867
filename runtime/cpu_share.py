"""How many threads the CPU forward uses: the share of the cores other processes leave free.

OpenMP splits each GEMM, kernel and norm of a step evenly over its threads and waits at the end
of each for the slowest. When other processes take cores, one of our threads is descheduled in
the middle of most regions and every region waits for it while the others spin: on 2 cores a
busy neighbour slowed a step 3-4x, where losing a core should cost 2x (RESULTS.md, busy_bench).
Sleeping instead of spinning (OMP_WAIT_POLICY=PASSIVE) avoids that but pays a wake-up per
region on a quiet machine, ~35% of decode speed here. So the engine keeps OpenMP's spinning
workers and adapts their number: about once a second it reads how much CPU time the rest of the
machine used on this process's CPUs (busy and stolen time from /proc/stat, minus this process's
own) and runs as many threads as that leaves room for, one step up or down at a time, with a
margin each way so that it does not flap.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 1.0  # how often the counters are read
SMOOTHING = 0.5  # weight of the newest window in the running estimate
DOWN_MARGIN = 0.4  # threads the free share must fall below the current count to drop one
UP_MARGIN = 0.75  # threads it must rise above it to add one


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds: the CPUs' busy and stolen time, and this process's own."""

    machine_busy_s: float
    own_s: float


def read_sample(cpus: frozenset[int]) -> CpuSample:
    """Busy + steal seconds of `cpus` from /proc/stat, and this process's user + system."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    busy_ticks = 0
    with open("/proc/stat", encoding="ascii") as stat:
        for line in stat:
            name, *fields = line.split()
            if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
                continue
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            busy_ticks += user + nice + system + irq + softirq + steal
    times = os.times()
    return CpuSample(busy_ticks / ticks_per_s, times.user + times.system)


class CpuShare:
    """The thread count for this process's share of its CPUs; `update()` once a step, on the
    thread that runs the forward (OpenMP's thread count is per calling thread).

    >>> share = CpuShare(max_threads=2, num_cpus=2, sample=lambda: CpuSample(0.0, 0.0))
    >>> share.threads
    2
    """

    def __init__(
        self,
        max_threads: int,
        num_cpus: int,
        sample: Callable[[], CpuSample],
        set_threads: Callable[[int], None] = lambda n: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max_threads
        self.num_cpus = num_cpus
        self.threads = max_threads
        self.others_cpus = 0.0  # smoothed: CPUs' worth the rest of the machine uses
        self._sample = sample
        self._set_threads = set_threads
        self._clock = clock
        self._last = (clock(), sample())

    @classmethod
    def for_this_process(cls) -> CpuShare | None:
        """Over this process's CPUs, starting from torch's thread count, setting torch's; None
        where the OS does not tell (no /proc/stat)."""
        import torch

        if not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"):
            return None
        cpus = frozenset(os.sched_getaffinity(0))
        return cls(torch.get_num_threads(), len(cpus), lambda: read_sample(cpus), _set_torch)

    def update(self) -> int:
        """Re-estimate if a window has passed; the thread count to run with now."""
        now = self._clock()
        last_time, last = self._last
        if now - last_time < WINDOW_S:
            return self.threads
        sample = self._sample()
        self._last = (now, sample)
        others_s = (sample.machine_busy_s - last.machine_busy_s) - (sample.own_s - last.own_s)
        others = min(max(others_s / (now - last_time), 0.0), float(self.num_cpus))
        self.others_cpus += SMOOTHING * (others - self.others_cpus)
        room = self.max_threads * (1.0 - self.others_cpus / self.num_cpus)
        if room < self.threads - DOWN_MARGIN and self.threads > 1:
            self._change(self.threads - 1)
        elif room > self.threads + UP_MARGIN and self.threads < self.max_threads:
            self._change(self.threads + 1)
        return self.threads

    def _change(self, threads: int) -> None:
        self.threads = threads
        self._set_threads(threads)


def _set_torch(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
