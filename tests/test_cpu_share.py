"""The engine's thread count follows the cores other processes leave free: all of them when
the machine is quiet, one fewer beside a busy neighbour, back when it leaves, and no flapping
on the way."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cpu_share import WINDOW_S, CpuSample, CpuShare, read_sample


class Machine:
    """A fake clock and CPU counters: each window, others use `others` CPUs, we use `ours`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy_s = 0.0
        self.own_s = 0.0
        self.set_calls: list[int] = []

    def sample(self) -> CpuSample:
        return CpuSample(self.busy_s, self.own_s)

    def advance(self, others: float, ours: float, seconds: float = WINDOW_S) -> None:
        self.now += seconds
        self.busy_s += (others + ours) * seconds
        self.own_s += ours * seconds

    def share(self, max_threads: int = 2, num_cpus: int = 2) -> CpuShare:
        return CpuShare(
            max_threads, num_cpus, self.sample, self.set_calls.append, clock=lambda: self.now
        )


def run(machine: Machine, share: CpuShare, others: float, windows: int) -> list[int]:
    counts = []
    for _ in range(windows):
        machine.advance(others, ours=float(share.threads))
        counts.append(share.update())
    return counts


def test_a_quiet_machine_keeps_every_thread_and_never_touches_torchs_setting():
    machine = Machine()
    share = machine.share()
    assert run(machine, share, others=0.05, windows=20) == [2] * 20
    assert machine.set_calls == []


def test_a_busy_neighbour_takes_one_thread_and_gives_it_back_when_it_leaves():
    machine = Machine()
    share = machine.share()
    # beside spinning workers a CPU-bound neighbour gets about 2/3 of a core
    busy = run(machine, share, others=0.67, windows=6)
    assert busy[-1] == 1 and busy[0] == 2  # smoothed: not on the first window
    # with one thread of ours it has its core to itself: the share stays at one
    assert run(machine, share, others=1.0, windows=10) == [1] * 10
    after = run(machine, share, others=0.0, windows=6)
    assert after[-1] == 2
    assert machine.set_calls == [1, 2]  # one change each way, nothing in between


def test_it_reads_the_counters_at_most_once_a_window():
    machine = Machine()
    reads = []
    share = CpuShare(2, 2, lambda: reads.append(1) or machine.sample(), clock=lambda: machine.now)
    for _ in range(40):  # 5 windows, in steps of an eighth (exact in binary)
        machine.advance(others=1.0, ours=2.0, seconds=WINDOW_S / 8)
        share.update()
    assert len(reads) == 1 + 5  # the first sample, then one per window


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 8.0), min_size=1, max_size=60), st.sampled_from([2, 4, 8]))
def test_the_count_stays_in_range_and_moves_one_thread_at_a_time(loads, num_cpus):
    machine = Machine()
    share = machine.share(max_threads=num_cpus, num_cpus=num_cpus)
    previous = share.threads
    for others in loads:
        machine.advance(min(others, num_cpus), ours=float(share.threads))
        count = share.update()
        assert 1 <= count <= num_cpus and abs(count - previous) <= 1
        previous = count
    assert machine.set_calls == [] or machine.set_calls[-1] == share.threads


def test_the_real_counters_count_this_process():
    cpus = frozenset(os.sched_getaffinity(0))
    before = read_sample(cpus)
    total = 0
    for i in range(3_000_000):  # ~0.2 s of CPU
        total += i
    after = read_sample(cpus)
    used_s = after.own_s - before.own_s
    assert used_s > 0.05 and after.machine_busy_s - before.machine_busy_s >= used_s * 0.5
