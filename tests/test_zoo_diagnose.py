"""The compact allocator trace benchmarks/zoo/diagnose.py writes and zoo/allocdiff.py reads,
on a hand-made allocator trace whose op boundaries are known."""

from __future__ import annotations

from zoo import allocdiff

MiB = 2**20


def _trace():
    """Op A (starts at 0 allocs, 0 frees) allocates x and y in a new segment; op B (starts at
    2 allocs) frees x (requested, then completed) and allocates z; op C (starts at 3 allocs, 1
    free) allocates w at x's old address and frees y."""
    marks = [(0, 0, 10, 11, 12, 13), (2, 0, 20, 11, 12, 13), (3, 1, 30, 11, 12, 13)]
    seg = {"action": "segment_alloc", "addr": 1000, "size": 2 * MiB}
    a = lambda addr, n: {"action": "alloc", "addr": addr, "size": n}  # noqa: E731
    f = lambda addr, n, what="free_completed": {"action": what, "addr": addr, "size": n}  # noqa
    trace = [
        seg,
        a(1000, 100),
        a(1512, 200),
        f(1000, 100, "free_requested"),
        f(1000, 100),
        a(2024, 300),
        a(1000, 50),
        f(1512, 200),
    ]
    return trace, marks


def test_compact_trace_tags_each_event_with_the_op_running():
    trace, marks = _trace()
    out = allocdiff.compact_trace(trace, marks, [("build", (0, 0)), ("step1", (2, 1))])
    # free_requested is left out; the free of x names alloc 0, the free of y alloc 1
    assert out["events"] == [
        [2, 2 * MiB, 0, 1000],
        [0, 100, 0],
        [0, 200, 0],
        [1, 0, 1],
        [0, 300, 1],
        [0, 50, 2],
        [1, 1, 2],
    ]
    assert out["ops"] == [[10, 11, 12, 13], [20, 11, 12, 13], [30, 11, 12, 13]]
    assert out["phase_starts"] == [["build", 0], ["step1", 4]]


def test_allocdiff_reads_the_compact_trace_back():
    trace, marks = _trace()
    row = allocdiff.compact_trace(trace, marks, [("build", (0, 0)), ("step1:forward", (2, 1))])
    strings = [""] * 40
    strings[10], strings[20], strings[30], strings[11] = (
        "aten.mm.default",
        "aten.add.Tensor",
        "aten.mul.Tensor",
        "fc",
    )
    row.update(strings=strings)
    build, step = allocdiff.real_steps(row)
    assert [e[:2] for e in build["events"]] == [(2, 2 * MiB), (0, 100), (0, 200), (1, 100)]
    assert [(e[0], e[1], e[2]) for e in step["events"]] == [
        (0, 300, "add @ fc"),
        (0, 50, "mul @ fc"),
        (1, 200, "mul @ fc"),
    ]
