"""The caching-allocator replay against hand-derived sequences and recorded H100 measurements.

Hand-derived: each case below works out, from the rules in CUDACachingAllocator.cpp, the
blocks and segments a sequence of torch.empty requests gets (comments carry the arithmetic).
Recorded: benchmarks/memory/allocator_truth.py ran the same kinds of sequences (zoo/
allocator_sequences.py) on an H100 and wrote max_memory_allocated, max_memory_reserved and the
segment count of each; every sequence is replayed here and must match exactly.
"""

import json
from pathlib import Path

import pytest

from gobrrr.memory.allocator import (
    CachingAllocator,
    OutOfMemory,
    replay,
    round_size,
    segment_size,
)
from zoo import allocator_sequences

ROOT = Path(__file__).resolve().parents[1]
TRUTH = ROOT / "tests" / "fixtures" / "allocator_truth_h100.json"

KiB, MiB = 1024, 1024**2


@pytest.mark.parametrize(
    "n,expected", [(1, 512), (511, 512), (512, 512), (513, 1024), (MiB + 1, MiB + 512)]
)
def test_requests_round_to_512_bytes(n, expected):
    assert round_size(n) == expected


@pytest.mark.parametrize(
    "size,expected",
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),  # small pool: 2 MiB segments
        (MiB + 512, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),  # 1-10 MiB share 20 MiB segments
        (10 * MiB, 10 * MiB),
        (11 * MiB, 12 * MiB),
        (33 * MiB + 512, 34 * MiB),
    ],
)  # 2 MiB steps
def test_segment_sizes(size, expected):
    assert segment_size(size) == expected


def _a(tid, n):
    return ("a", tid, n)


def _f(tid):
    return ("f", tid)


# name: (events, budget, allocated peak, reserved peak, segments peak, ooms), by hand
HAND = {
    # 3 x 600 KiB = 1800 KiB in one 2 MiB segment (248 KiB left); the freed middle block is
    # reused whole; a 5th request fits neither hole nor tail: a second segment
    "three_600k_one_segment": (
        [_a(0, 600 * KiB), _a(1, 600 * KiB), _a(2, 600 * KiB)],
        None,
        3 * 600 * KiB,
        2 * MiB,
        1,
        0,
    ),
    "small_pack": (allocator_sequences.small_pack().events, None, 4 * 600 * KiB, 4 * MiB, 2, 0),
    "5mib_takes_20mib": ([_a(0, 5 * MiB)], None, 5 * MiB, 20 * MiB, 1, 0),
    # 11 MiB: a 12 MiB segment; the 1 MiB remainder is not > 1 MiB, so it stays in the block
    "11mib_takes_12mib": ([_a(0, 11 * MiB)], None, 12 * MiB, 12 * MiB, 1, 0),
    # exactly 1 MiB is small (2 MiB segment); 1 MiB + 1 rounds to 1 MiB + 512, large pool
    "boundary_1mib": ([_a(0, MiB), _a(1, MiB + 1)], None, 2 * MiB + 512, 22 * MiB, 2, 0),
    # 20 MiB segment cut 4+16, 4+12, 4+8, 4+4, then the last 4 whole; the 6th needs a second
    # segment. 3 MiB into the freed 4 MiB hole keeps all 4 (1 MiB remainder not split);
    # 2 MiB + 512 and 9.5 MiB come out of the second segment's 16 MiB
    "mid_pack": (
        allocator_sequences.mid_pack().events,
        None,
        6 * 4 * MiB + 2 * MiB + 512 + 9 * MiB + 512 * KiB,
        40 * MiB,
        2,
        0,
    ),
    # 19.5 MiB -> 20 MiB segment, kept whole; 9.5 MiB -> 20 MiB segment cut 9.5 + 10.5; 9.59 MiB
    # takes the whole 10.5 (0.91 MiB remainder); 8 MiB into the freed 9.5 (1.5 MiB split off);
    # 11 MiB -> 12 MiB whole; 10 MiB -> 10 MiB; 10 MiB + 1 -> 12 MiB segment cut;
    # 33 MiB + 1 -> 34 MiB whole
    "split_rules": (
        allocator_sequences.split_rules().events,
        None,
        20 * MiB + 21 * MiB // 2 + 8 * MiB + 12 * MiB + 10 * MiB + 10 * MiB + 512 + 34 * MiB,
        (20 + 20 + 12 + 10 + 12 + 34) * MiB,
        6,
        0,
    ),
    # 64 MiB segment freed; 32 from it, 40 new, 30 into the 32 MiB remainder (best fit);
    # freeing 32 and 30 coalesces the whole 64 MiB again, which serves 48; 100 is new; 12 goes
    # into the 16 MiB left. Allocated peak 48 + 100 + 12
    "large_reuse": (allocator_sequences.large_reuse().events, None, 160 * MiB, 204 * MiB, 3, 0),
    # budget 256 MiB: two cached 100 MiB segments are released for 150 MiB (retry 1); 4 MiB
    # (20 MiB segment) and 600 KiB (2 MiB) are split, so unreleasable: 90 MiB fails (retry 2,
    # OOM); the freed 150 MiB is released for 200 MiB (retry 3); 30 MiB fits (252 MiB);
    # 8 MiB comes from the 16 MiB left in the 20 MiB segment
    "oom_retry": (
        allocator_sequences.oom_retry().events,
        256 * MiB,
        4 * MiB + 600 * KiB + 200 * MiB + 30 * MiB + 8 * MiB,
        252 * MiB,
        4,
        1,
    ),
}


@pytest.mark.parametrize("name", list(HAND))
def test_hand_derived_sequences(name):
    events, budget, allocated, reserved, segments, ooms = HAND[name]
    s = replay(events, budget).stats
    assert (s.allocated_peak, s.reserved_peak, s.segments_peak, s.ooms) == (
        allocated,
        reserved,
        segments,
        ooms,
    )


def test_oom_path_releases_only_wholly_free_segments():
    s = replay(allocator_sequences.oom_retry().events, 256 * MiB).stats
    assert (s.alloc_retries, s.device_allocs, s.device_frees) == (3, 7, 3)
    assert s.reserved == 252 * MiB


def test_out_of_memory_raises_with_the_numbers():
    alloc = CachingAllocator(budget=30 * MiB)
    alloc.malloc(12 * MiB)
    with pytest.raises(OutOfMemory, match="reserved"):
        alloc.malloc(20 * MiB)  # 12 + 20 > 30, and the 12 MiB segment is in use


def test_fragmentation_at_the_reserved_peak():
    # 3 MiB blocks fill 20 MiB segments six at a time (2 MiB tails); freeing every other one
    # leaves 3 MiB holes that a 5 MiB request cannot use
    alloc = CachingAllocator()
    hs = [alloc.malloc(3 * MiB) for _ in range(12)]  # two 20 MiB segments, 36 MiB allocated
    for h in hs[::2]:
        alloc.free(h)  # 18 MiB allocated, six 3 MiB holes
    alloc.malloc(5 * MiB)  # a third segment: reserved 60 MiB, allocated 23 MiB
    s = alloc.stats()
    assert (s.reserved_peak, s.allocated_peak) == (60 * MiB, 36 * MiB)
    assert s.fragmentation == 60 * MiB - 23 * MiB
    assert s.fragmentation_share == pytest.approx(37 / 60)


def test_best_fit_prefers_the_smallest_block_then_the_lowest_address():
    alloc = CachingAllocator()
    big = [alloc.malloc(24 * MiB) for _ in range(2)]  # two 24 MiB segments
    small = alloc.malloc(16 * MiB)  # a 16 MiB segment
    for h in (*big, small):
        alloc.free(h)
    alloc.malloc(15 * MiB)  # best fit: the 16 MiB segment (remainder 1 MiB stays in it)
    alloc.malloc(20 * MiB)  # the lower-addressed 24 MiB segment, cut 20 + 4
    alloc.malloc(21 * MiB)  # the other 24 MiB segment (cut 21 + 3): nothing new
    s = alloc.stats()
    assert (s.segments, s.reserved_peak, s.allocated) == (3, 64 * MiB, 16 * MiB + 41 * MiB)
    assert alloc.segment_sizes() == [24 * MiB, 24 * MiB, 16 * MiB]
    assert alloc.layout() == [
        [(20 * MiB, True), (4 * MiB, False)],
        [(21 * MiB, True), (3 * MiB, False)],
        [(16 * MiB, True)],
    ]


# ------------------------------------------------------------------------------- recorded
def _truth() -> dict:
    if not TRUTH.exists():
        pytest.skip(
            f"{TRUTH.relative_to(ROOT)} is absent: run "
            "benchmarks/memory/allocator_truth.py on an H100 and commit its JSON to "
            "check the replay against the device"
        )
    return json.loads(TRUTH.read_text())


def _budget(rec: dict) -> int | None:
    """The limit the allocator enforced: int(fraction * total), as setMemoryFraction does."""
    if rec.get("fraction") is None:
        return None
    return int(rec["fraction"] * rec["device_total"])


def test_recorded_sequences_are_the_scripts():
    truth = _truth()
    for name, rec in truth["sequences"].items():
        build, _limit = allocator_sequences.SEQUENCES[name]
        assert [list(e) for e in build().events] == rec["events"], name


@pytest.mark.parametrize("name", list(allocator_sequences.SEQUENCES))
def test_recorded_peaks_match_exactly(name):
    truth = _truth()
    if name not in truth["sequences"]:
        pytest.skip(f"{name} was not recorded")
    rec = truth["sequences"][name]
    r = replay(rec["events"], _budget(rec))
    first = next(
        (
            i
            for i, (got, want) in enumerate(zip(r.trace, rec["trace"], strict=True))
            if list(got) != list(want)
        ),
        None,
    )
    where = (
        f"first divergence at event {first}: {rec['events'][first]}"
        if first is not None
        else "traces agree"
    )
    assert r.stats.allocated_peak == rec["max_memory_allocated"], where
    assert r.stats.reserved_peak == rec["max_memory_reserved"], where
    assert r.stats.segments_peak == rec["segments_peak"], where
    assert list(r.oom_events) == rec["oom_events"], where


def _trace_events(trace: list) -> tuple[list, list[int]]:
    """A recorded allocator trace as replay events, and cudaMalloc's address of each segment
    in turn (codes: a alloc, f free, s segment alloc, S segment free)."""
    events, addresses, ids = [], [], {}
    for code, addr, nbytes in trace:
        if code == "a":
            ids[addr] = len(events)  # the event's index: unique
            events.append(("a", ids[addr], nbytes))
        elif code == "f" and addr in ids:
            events.append(("f", ids.pop(addr)))
        elif code == "s":
            addresses.append(addr)
    return events, addresses


def test_trace_events_pair_frees_with_allocations_by_address():
    base = 1 << 40
    trace = [
        ["s", base, 2 * MiB],
        ["a", base, 600 * KiB],
        ["a", base + 600 * KiB, 600 * KiB],
        ["f", base, 600 * KiB],
        ["a", base, 100],
        ["s", base + 4 * MiB, 20 * MiB],
        ["a", base + 4 * MiB, 5 * MiB],
        ["f", base + 600 * KiB, 600 * KiB],
    ]
    events, addresses = _trace_events(trace)
    assert events == [
        ("a", 0, 600 * KiB),
        ("a", 1, 600 * KiB),
        ("f", 0),
        ("a", 3, 100),
        ("a", 4, 5 * MiB),
        ("f", 1),
    ]
    r = replay(events, addresses=addresses)
    assert (r.stats.reserved_peak, r.stats.allocated_peak) == (22 * MiB, 600 * KiB + 512 + 5 * MiB)


def _recorded_steps() -> list:
    return json.loads(TRUTH.read_text()).get("steps", []) if TRUTH.exists() else []


@pytest.mark.parametrize("case", [s["case"] for s in _recorded_steps()] or ["(none recorded)"])
def test_recorded_training_steps_replay_exactly(case):
    """The allocator's own trace of a real training run (model build + 4 steps), replayed
    with the addresses cudaMalloc returned: the same peaks and segments."""
    truth = _truth()
    rec = next((s for s in truth.get("steps", []) if s["case"] == case), None)
    if rec is None:
        pytest.skip("no training step recorded (allocator_truth.py --steps)")
    events, addresses = _trace_events(rec["trace"])
    r = replay(events, addresses=addresses)
    assert r.stats.reserved_peak == rec["max_memory_reserved"]
    assert r.stats.allocated_peak == rec["max_memory_allocated"]
    assert r.stats.device_allocs == len(addresses)


def test_cuda_context_assumption_is_near_the_recording():
    """The budget leaves CUDA_CONTEXT_BYTES for what the process holds outside the allocator;
    the recording measured it with cuBLAS and cuDNN loaded."""
    from gobrrr.memory.replay import CUDA_CONTEXT_BYTES

    context = _truth().get("context")
    if not context:
        pytest.skip("the recording has no context measurement")
    measured = context[-1]["outside_allocator"]
    assert abs(CUDA_CONTEXT_BYTES - measured) <= 0.02 * measured, (
        f"{measured / MiB:.0f} MiB measured outside the allocator ({context[-1]['when']}), "
        f"{CUDA_CONTEXT_BYTES / MiB:.0f} MiB assumed"
    )


PLAIN = ROOT / "tests" / "fixtures" / "zoo_diagnose_plain_h100.json"
#: the zoo cases whose reserved peak depends on where cudaMalloc puts each segment
ADDRESS_SENSITIVE = {"convnext_tiny-timm-gc": -0.109}


def _zoo_traces() -> list[dict]:
    if not PLAIN.exists():
        return []
    alloc = json.loads(PLAIN.read_text())["alloc"]
    return list(alloc.values()) if isinstance(alloc, dict) else alloc


@pytest.mark.parametrize("row", _zoo_traces(), ids=lambda r: r["name"])
def test_zoo_steps_replay_exactly_and_addresses_matter_only_where_known(row):
    """The zoo's allocator traces (a model build and four steps each, as the zoo measures
    them): replayed with the addresses cudaMalloc returned, the GPU's own reserved peak.
    Replayed with the modelled addresses (segments laid out in the order they are made), the
    same, except where equal-size free blocks in different segments compete and the real
    addresses decide otherwise: ConvNeXt-T with checkpointing, whose real requests replay
    10.9% low with modelled addresses, its prediction's -11.0% (tests/test_zoo.py)."""
    from zoo.allocdiff import real_steps

    steps = real_steps(row)
    events = [
        ("a", e[3], e[1]) if e[0] == 0 else ("f", e[3])
        for s in steps
        for e in s["events"]
        if e[0] in (0, 1)
    ]
    addresses = [e[3] for s in steps for e in s["events"] if e[0] == 2]
    assert replay(events, addresses=addresses).stats.reserved_peak == row["max_memory_reserved"]
    modelled = replay(events).stats.reserved_peak / row["max_memory_reserved"] - 1
    assert modelled == pytest.approx(ADDRESS_SENSITIVE.get(row["name"], 0.0), abs=0.001)
