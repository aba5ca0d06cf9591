"""A replay of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp).

`max_memory_allocated` counts the blocks handed out; `max_memory_reserved` counts the segments
obtained from cudaMalloc, which is what the device really runs out of. This module reproduces
how the allocator turns a sequence of requests and frees into blocks and segments, with its
default settings (no max_split_size, expandable_segments off, no garbage-collection threshold,
no CUDA graphs), each stream's free blocks in a pool of their own:

1. A request of n bytes is rounded up to a multiple of 512 bytes (at least 512).
2. Requests of at most 1 MiB come from the small pool, larger ones from the large pool.
3. The pool's free blocks are searched best fit: the smallest block at least as large,
   ties broken by the lowest address.
4. If none fits, a new segment is obtained (cudaMalloc): 2 MiB for a small request, 20 MiB for
   a request under 10 MiB, else the request rounded up to a multiple of 2 MiB.
5. The block found is split when the remainder is worth keeping: in the small pool when it is
   at least 512 bytes, in the large pool when it is more than 1 MiB. Otherwise the whole block
   is handed out (and counts as allocated).
6. A freed block merges with its free neighbours in the same segment.
7. If a new segment would exceed the budget (cudaMalloc fails), every cached segment that is
   wholly free is released (cudaFree) and the segment is tried once more; if that fails too,
   the request is out of memory.

Addresses are modelled: segments are laid out one after another in the order they are created.
cudaMalloc's real addresses matter only where two free blocks of equal size compete (the lower
address wins); a replay of a recorded trace can pass the addresses cudaMalloc returned.
"""

from __future__ import annotations

import copy
from bisect import bisect_left, insort
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from gobrrr.errors import GobrrrError

MiB = 1024**2
MIN_BLOCK = 512  # kMinBlockSize: every request is rounded to a multiple of this
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: the segment size of the small pool
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the segment for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here a request gets its own segment
ROUND_LARGE = 2 * MiB  # kRoundLarge: those segments are rounded up to a multiple of this


def round_size(nbytes: int) -> int:
    """Bytes of the block the allocator hands out for a request of `nbytes` (before any
    remainder is kept in the block, see `CachingAllocator.malloc`)."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((nbytes + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size: int) -> int:
    """Bytes of the segment (one cudaMalloc) made for a rounded request of `size` bytes."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


class OutOfMemory(GobrrrError):
    """A request the allocator cannot serve within its budget, even after releasing every
    wholly free cached segment (PyTorch raises torch.OutOfMemoryError there)."""

    def __init__(self, nbytes: int, allocated: int, reserved: int, budget: int) -> None:
        super().__init__(
            f"out of memory: a request of {nbytes} bytes needs a new segment, but "
            f"{reserved} bytes are reserved ({allocated} allocated) of a budget of {budget}; "
            "lower the batch size or use activation checkpointing"
        )
        self.nbytes, self.allocated, self.reserved, self.budget = (
            nbytes,
            allocated,
            reserved,
            budget,
        )


class _Block:
    __slots__ = ("addr", "size", "small", "allocated", "prev", "next", "segment", "stream")

    def __init__(self, addr: int, size: int, small: bool, segment: int, stream: str) -> None:
        self.addr, self.size, self.small, self.segment = addr, size, small, segment
        self.stream = stream  # the stream whose pool holds it (the one that allocated it)
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Free blocks ordered by (size, address), like the allocator's std::set of blocks. Each
    key is the pair packed into one int, size << 64 | address (addresses are 64-bit), so the
    order is the pair's and comparing keys is one int comparison."""

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}

    def add(self, b: _Block) -> None:
        key = b.size << 64 | b.addr
        insort(self.keys, key)
        self.blocks[key] = b

    def remove(self, b: _Block) -> None:
        key = b.size << 64 | b.addr
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]

    def best_fit(self, size: int) -> _Block | None:
        """The smallest free block of at least `size` bytes (lowest address first)."""
        i = bisect_left(self.keys, size << 64)
        return self.blocks[self.keys[i]] if i < len(self.keys) else None

    def take(self, size: int) -> _Block | None:
        """`best_fit`, taken out of the pool."""
        keys = self.keys
        i = bisect_left(keys, size << 64)
        return self.blocks.pop(keys.pop(i)) if i < len(keys) else None


@dataclass(frozen=True)
class AllocatorStats:
    """What the allocator's counters say, in bytes and counts.

    allocated_peak / reserved_peak: max_memory_allocated / max_memory_reserved.
    allocated / reserved / segments: current values. segments_peak: most segments at once.
    fragmentation: bytes of the reserved peak never handed out at once while the reserved
    memory stood at its peak (reserved_peak minus the most allocated then).
    alloc_retries: requests retried after releasing cached segments; ooms: requests refused.
    device_allocs / device_frees: cudaMalloc / cudaFree calls.
    """

    allocated_peak: int
    reserved_peak: int
    allocated: int
    reserved: int
    segments: int
    segments_peak: int
    fragmentation: int
    alloc_retries: int
    ooms: int
    device_allocs: int
    device_frees: int

    @property
    def fragmentation_share(self) -> float:
        """fragmentation as a fraction of the reserved peak."""
        return self.fragmentation / self.reserved_peak if self.reserved_peak else 0.0


class CachingAllocator:
    """The caching allocator of one device, one pool of cached blocks per stream (a block
    freed returns to the stream that allocated it). `budget`: bytes that segments may take
    in all (the device memory left to the process); None = unlimited. `addresses`: the
    address of each new segment in turn (what cudaMalloc returned in a recorded run); None =
    each new segment right after the previous one."""

    def __init__(self, budget: int | None = None, addresses: Iterator[int] | None = None) -> None:
        self.budget = budget
        self._addresses = addresses
        # (stream, small) -> free blocks: a block freed goes back to the pool of the stream
        # that allocated it, which alone reuses it (the allocator's per-stream free lists)
        self._pools: dict[tuple[str, bool], _Pool] = defaultdict(_Pool)
        self._live: dict[int, _Block] = {}  # handle -> allocated block
        self._segments: dict[int, int] = {}  # segment id -> size
        self._next_handle = self._next_segment = self._next_addr = 0
        self.allocated = self.reserved = 0
        self.allocated_peak = self.reserved_peak = self.segments_peak = 0
        self._allocated_at_reserved_peak = 0
        self.alloc_retries = self.ooms = self.device_allocs = self.device_frees = 0
        # another budget to watch (None: none): `parted` is set once a segment is asked for
        # that would pass it (an allocator with that budget would have refused it)
        self.watch: int | None = None
        self.parted = False

    # --------------------------------------------------------------------------- requests
    def malloc(self, nbytes: int, stream: str = "compute") -> int:
        """Serve a request of `nbytes` (> 0) made on `stream`; returns a handle for `free`.
        Raises OutOfMemory when no segment can be made within the budget."""
        if nbytes <= 0:
            raise GobrrrError(f"a request of {nbytes} bytes: the allocator serves sizes > 0")
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._pools[stream, small].take(size)
        if block is None:
            block = self._new_segment(segment_size(size), small, stream)
        if block is None:  # cudaMalloc failed: release what is wholly free, then retry once
            self.empty_cache()
            self.alloc_retries += 1
            block = self._new_segment(segment_size(size), small, stream)
        if block is None:
            self.ooms += 1
            raise OutOfMemory(nbytes, self.allocated, self.reserved, self.budget or 0)
        if block.size - size >= (MIN_BLOCK if small else SMALL_SIZE + 1):  # worth keeping
            block = self._split(block, size)
        block.allocated = True
        allocated = self.allocated = self.allocated + block.size
        if allocated > self.allocated_peak:
            self.allocated_peak = allocated
        if self.reserved == self.reserved_peak and allocated > self._allocated_at_reserved_peak:
            self._allocated_at_reserved_peak = allocated
        handle = self._next_handle
        self._next_handle = handle + 1
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """Return a block to its pool, merged with its free neighbours."""
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        pool = self._pools[block.stream, block.small]
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                pool.remove(other)
                self._merge(block, other)
        pool.add(block)

    def empty_cache(self) -> None:
        """Release every cached segment that holds no allocated block (cudaFree)."""
        for pool in self._pools.values():
            for b in [b for b in pool.blocks.values() if not b.is_split()]:
                pool.remove(b)
                del self._segments[b.segment]
                self.reserved -= b.size
                self.device_frees += 1

    def block_size(self, handle: int) -> int:
        """Bytes the allocator counts for an allocated block (its request rounded, plus any
        remainder it kept)."""
        return self._live[handle].size

    def reset_peaks(self) -> None:
        """Peaks back to the current values, as torch.cuda.reset_peak_memory_stats()."""
        self.allocated_peak, self.reserved_peak = self.allocated, self.reserved
        self.segments_peak = len(self._segments)
        self._allocated_at_reserved_peak = self.allocated

    def copy(self) -> CachingAllocator | None:
        """A copy of this allocator, its blocks and pools its own (a replay goes on from it
        with another budget, `memory.replay`); None where its segments' addresses come from
        an iterator (which cannot be copied)."""
        if self._addresses is not None:
            return None
        twin: dict[int, _Block] = {}
        for b in self._blocks():
            c = twin[id(b)] = _Block(b.addr, b.size, b.small, b.segment, b.stream)
            c.allocated = b.allocated
        for b in self._blocks():
            c = twin[id(b)]
            c.prev = twin[id(b.prev)] if b.prev is not None else None
            c.next = twin[id(b.next)] if b.next is not None else None
        new = copy.copy(self)  # the counters
        new._pools = defaultdict(_Pool)
        for key, pool in self._pools.items():
            p = new._pools[key]
            p.keys = list(pool.keys)
            p.blocks = {k: twin[id(b)] for k, b in pool.blocks.items()}
        new._live = {h: twin[id(b)] for h, b in self._live.items()}
        new._segments = dict(self._segments)
        return new

    def _blocks(self) -> Iterator[_Block]:
        """Every block: allocated, or free in a pool (a segment is made of them)."""
        yield from self._live.values()
        for pool in self._pools.values():
            yield from pool.blocks.values()

    # --------------------------------------------------------------------------- internals
    def _new_segment(self, size: int, small: bool, stream: str) -> _Block | None:
        if self.watch is not None and self.reserved + size > self.watch:
            self.parted = True
        if self.budget is not None and self.reserved + size > self.budget:
            return None
        addr = next(self._addresses) if self._addresses is not None else self._next_addr
        block = _Block(addr, size, small, self._next_segment, stream)
        self._segments[self._next_segment] = size
        self._next_addr = max(self._next_addr, addr + size)
        self._next_segment += 1
        self.reserved += size
        self.device_allocs += 1
        self.segments_peak = max(self.segments_peak, len(self._segments))
        if self.reserved > self.reserved_peak:
            self.reserved_peak = self.reserved
            self._allocated_at_reserved_peak = self.allocated
        return block

    def _split(self, block: _Block, size: int) -> _Block:
        """Cut `size` bytes off the front of `block` (the remainder is worth keeping: in the
        small pool at least MIN_BLOCK bytes, in the large one more than SMALL_SIZE); the
        remainder goes back to the pool."""
        remaining = block.size - size
        front = _Block(block.addr, size, block.small, block.segment, block.stream)
        front.prev, front.next = block.prev, block
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.addr += size
        block.size = remaining
        self._pools[block.stream, block.small].add(block)
        return front

    @staticmethod
    def _merge(dst: _Block, src: _Block) -> None:
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # --------------------------------------------------------------------------- results
    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocated_peak=self.allocated_peak,
            reserved_peak=self.reserved_peak,
            allocated=self.allocated,
            reserved=self.reserved,
            segments=len(self._segments),
            segments_peak=self.segments_peak,
            fragmentation=self.reserved_peak - self._allocated_at_reserved_peak,
            alloc_retries=self.alloc_retries,
            ooms=self.ooms,
            device_allocs=self.device_allocs,
            device_frees=self.device_frees,
        )

    def segment_sizes(self) -> list[int]:
        """Sizes of the segments held now, in the order they were made."""
        return [self._segments[k] for k in sorted(self._segments)]

    def layout(self) -> list[list[tuple[int, bool]]]:
        """Each segment held now (in the order they were made) as its blocks from the lowest
        address: (bytes, allocated)."""
        blocks = [
            *self._live.values(),
            *(b for p in self._pools.values() for b in p.blocks.values()),
        ]
        segs: dict[int, list[_Block]] = {}
        for b in blocks:
            segs.setdefault(b.segment, []).append(b)
        return [
            [(b.size, b.allocated) for b in sorted(segs[k], key=lambda b: b.addr)]
            for k in sorted(segs)
        ]


@dataclass(frozen=True)
class Replay:
    """A replayed sequence: the final counters, the events that ran out of memory, and
    (allocated, reserved, segments) after each event."""

    stats: AllocatorStats
    oom_events: tuple[int, ...]
    trace: tuple[tuple[int, int, int], ...]


def replay(
    events: Iterable[Sequence], budget: int | None = None, addresses: Iterable[int] | None = None
) -> Replay:
    """Replay `events`: ("a", id, nbytes) allocates, ("f", id) frees (the format of
    benchmarks/memory/allocator_truth.py). A request that runs out of memory is recorded and
    skipped, and a later free of it ignored, as a program that catches torch.OutOfMemoryError would.
    `addresses`: cudaMalloc's address for each new segment in turn (default: modelled)."""
    alloc = CachingAllocator(budget, iter(addresses) if addresses is not None else None)
    handles: dict[int, int] = {}
    ooms, trace = [], []
    for i, ev in enumerate(events):
        if ev[0] == "a":
            try:
                handles[ev[1]] = alloc.malloc(ev[2])
            except OutOfMemory:
                ooms.append(i)
        elif ev[0] == "f":
            if ev[1] in handles:
                alloc.free(handles.pop(ev[1]))
        else:
            raise GobrrrError(
                f"unknown allocator event {ev!r}: expected ('a', id, bytes) or ('f', id)"
            )
        trace.append((alloc.allocated, alloc.reserved, len(alloc._segments)))
    return Replay(alloc.stats(), tuple(ooms), tuple(trace))
