"""Deterministic sequences of allocations and frees (events `["a", id, bytes]`, `["f", id]`)
for the caching allocator: benchmarks/memory/allocator_truth.py runs them on a GPU, and
tests/test_allocator.py replays them through `gobrrr.memory.allocator` against its recording.
"""

from __future__ import annotations

import random

KiB, MiB = 1024, 1024 * 1024


class Seq:
    """Builds an event list; `a` allocates (returns the id), `f` frees by id."""

    def __init__(self) -> None:
        self.events: list[list] = []
        self.next_id = 0

    def a(self, nbytes: int) -> int:
        tid, self.next_id = self.next_id, self.next_id + 1
        self.events.append(["a", tid, int(nbytes)])
        return tid

    def f(self, tid: int) -> None:
        self.events.append(["f", tid])


def small_pack() -> Seq:
    """3 x 600 KiB share one 2 MiB segment; a 4th needs a second one."""
    s = Seq()
    ids = [s.a(600 * KiB) for _ in range(3)]
    s.f(ids[1])
    s.a(600 * KiB)  # reuses the freed 600 KiB block
    s.a(600 * KiB)  # a new 2 MiB segment
    return s


def small_odd_sizes() -> Seq:
    """Sizes around the 512 B rounding and the 1 MiB small/large boundary, freed and reused."""
    s = Seq()
    sizes = [
        1,
        511,
        512,
        513,
        1000,
        4096,
        65537,
        300 * KiB,
        MiB - 1,
        MiB,
        MiB + 1,
        MiB + 512,
        3 * KiB,
        700 * KiB,
        1500 * KiB,
    ]
    ids = [s.a(n) for n in sizes]
    for tid in ids[::2]:
        s.f(tid)
    for n in (256, 900 * KiB, 200 * KiB, MiB, 2 * MiB, 512 * KiB + 3):
        s.a(n)
    for tid in ids[1::2]:
        s.f(tid)
    s.a(1900 * KiB)
    return s


def mid_pack() -> Seq:
    """1-10 MiB requests: a 5 MiB request takes a 20 MiB segment; five 4 MiB blocks fill one."""
    s = Seq()
    first = s.a(5 * MiB)
    s.f(first)
    ids = [s.a(4 * MiB) for _ in range(6)]  # 5 fit (the 5th takes the last 4 MiB unsplit)
    s.f(ids[2])
    s.a(3 * MiB)  # 3 MiB into the 4 MiB hole: remainder 1 MiB is not split off (needs > 1 MiB)
    s.a(2 * MiB + 1)
    s.a(9 * MiB + 512 * KiB)
    return s


def split_rules() -> Seq:
    """Large-pool split only when the remainder exceeds 1 MiB; big segments rounded to 2 MiB."""
    s = Seq()
    s.a(19 * MiB + 512 * KiB)  # >= 10 MiB: a 20 MiB segment, remainder 0.5 MiB kept in the block
    x = s.a(9 * MiB + 512 * KiB)  # 20 MiB segment, split: 10.5 MiB free remainder
    s.a(9 * MiB + 600 * KiB)  # into the 10.5 MiB remainder, 0.9 MiB left unsplit
    s.f(x)
    s.a(8 * MiB)  # into the freed 9.5 MiB block, 1.5 MiB remainder split off
    s.a(11 * MiB)  # a 12 MiB segment, 1 MiB remainder unsplit
    s.a(10 * MiB)  # exactly 10 MiB: its own 10 MiB segment
    s.a(10 * MiB + 1)  # 12 MiB segment
    s.a(33 * MiB + 1)  # 34 MiB segment
    return s


def large_reuse() -> Seq:
    """A freed large segment serves smaller requests (best fit), then the cache is outgrown."""
    s = Seq()
    a = s.a(64 * MiB)
    s.f(a)
    b = s.a(32 * MiB)  # splits the cached 64 MiB segment
    c = s.a(40 * MiB)  # the 32 MiB remainder is too small: new 40 MiB segment
    d = s.a(30 * MiB)  # best fit: the 32 MiB remainder, not the bigger blocks
    s.f(b)
    s.f(d)  # coalesces with b's block back into the whole 64 MiB
    s.a(48 * MiB)
    s.f(c)
    s.a(100 * MiB)
    s.a(12 * MiB)
    return s


def fragment_holes() -> Seq:
    """3 MiB blocks freed alternately leave holes that 5 MiB requests cannot use."""
    s = Seq()
    ids = [s.a(3 * MiB) for _ in range(20)]
    for tid in ids[::2]:
        s.f(tid)
    big = [s.a(5 * MiB) for _ in range(6)]
    for n in (2 * MiB, 3 * MiB, 2 * MiB + 512 * KiB, 1 * MiB + 1):
        s.a(n)
    for tid in ids[1::2]:
        s.f(tid)
    for tid in big[:3]:
        s.f(tid)
    s.a(18 * MiB)
    s.a(25 * MiB)
    return s


def interleaved_pools() -> Seq:
    """Small and large requests interleaved, many small segments emptied and refilled."""
    s = Seq()
    live = []
    for i in range(60):
        live.append(s.a((i % 7 + 1) * 150 * KiB))
        if i % 5 == 0:
            live.append(s.a((i % 4 + 1) * 3 * MiB + 777))
        if i % 3 == 2:
            s.f(live.pop(len(live) // 2))
    for tid in live[::3]:
        s.f(tid)
    for i in range(20):
        s.a((i % 5 + 1) * 200 * KiB + 1)
    return s


def training_like(seed: int) -> Seq:
    """A step's shape: persistent params, forward activations, backward frees them in reverse
    while gradients appear, then an optimizer's temporaries; two steps."""
    rng = random.Random(seed)
    s = Seq()
    params = [
        rng.choice([4 * KiB, 96 * KiB, 2 * MiB + 4 * KiB, 9 * MiB, 36 * MiB]) for _ in range(24)
    ]
    for n in params:
        s.a(n)
    grads = None
    for _step in range(2):
        acts = []
        for _layer in range(12):
            for n in (rng.randint(1, 64) * 128 * KiB, 6 * MiB, rng.randint(1, 20) * MiB + 256):
                acts.append(s.a(n))
            tmp = s.a(rng.randint(8, 40) * MiB)
            s.f(tmp)
        new_grads = []
        for tid in reversed(acts):
            scratch = s.a(rng.randint(1, 16) * MiB)
            s.f(scratch)
            s.f(tid)
            if len(new_grads) < len(params) and rng.random() < 0.7:
                new_grads.append(s.a(params[len(new_grads)]))
        if grads is not None:
            for tid in grads:
                s.f(tid)
        grads = new_grads
        for n in params[:8]:
            t = s.a(n)
            s.f(t)
    return s


def random_mix(seed: int, events: int = 400) -> Seq:
    """Seeded random allocations (log-uniform 256 B - 48 MiB) and frees of random live ones."""
    rng = random.Random(seed)
    s = Seq()
    live: list[int] = []
    for _ in range(events):
        if live and rng.random() < 0.45:
            s.f(live.pop(rng.randrange(len(live))))
        else:
            live.append(s.a(int(2 ** rng.uniform(8, 25.6))))
    return s


def oom_retry() -> Seq:
    """Under a 256 MiB limit: cached segments released and the request retried, a split segment
    that cannot be released, then a request that fails (recorded as out of memory)."""
    s = Seq()
    a, b = s.a(100 * MiB), s.a(100 * MiB)
    s.f(a)
    s.f(b)  # 200 MiB cached in two segments
    c = s.a(150 * MiB)  # 200 + 150 > 256: free both cached segments, retry
    s.a(4 * MiB)  # a 20 MiB segment, split (kept alive: it cannot be released)
    s.a(600 * KiB)  # a 2 MiB small segment, split
    s.a(90 * MiB)  # 150 + 20 + 2 + 90 > 256 and nothing releasable: out of memory
    s.f(c)
    s.a(200 * MiB)  # 22 + 150 cached: releasing the unsplit 150 MiB makes room
    s.a(30 * MiB)  # 222 + 30 <= 256
    s.a(8 * MiB)  # fits in the 16 MiB left of the 20 MiB segment
    return s


SEQUENCES = {
    "small_pack": (small_pack, None),
    "small_odd_sizes": (small_odd_sizes, None),
    "mid_pack": (mid_pack, None),
    "split_rules": (split_rules, None),
    "large_reuse": (large_reuse, None),
    "fragment_holes": (fragment_holes, None),
    "interleaved_pools": (interleaved_pools, None),
    "training_like_s0": (lambda: training_like(0), None),
    "training_like_s1": (lambda: training_like(1), None),
    "random_s0": (lambda: random_mix(0), None),
    "random_s1": (lambda: random_mix(1), None),
    "random_s2": (lambda: random_mix(2, 800), None),
    "oom_retry": (oom_retry, 256 * MiB),  # (builder, memory limit in bytes or None)
}
