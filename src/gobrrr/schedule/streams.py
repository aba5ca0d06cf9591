"""The streams a step's ops run on, and the waits between them, as data.

The host issues every op in program order. A device stream runs the ops issued to it one
after another, each once the host has issued it and the waits before it are met. Waits are
CUDA's: an `Event` is a point on a stream (recorded at issue time, so it covers the work
issued to that stream so far, or one op's end), and a `Wait` holds a stream (the host
included) until that point has run. A sync is the host waiting for the compute stream (it
reads a GPU value); a copy of a gradient waits for the compute stream that produced it; a
collective on `comm` would wait for the op producing its input, and the op consuming its
output for the collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from gobrrr.graph.ir import OpNode

HOST = "host"  # the CPU thread issuing ops; ops that run on the CPU (offload's step) run here
COMPUTE = "compute"
COPY_D2H = "copy_d2h"
COPY_H2D = "copy_h2d"
COMM = "comm"
STREAMS = (HOST, COMPUTE, COPY_D2H, COPY_H2D, COMM)
COPY_STREAMS = (COPY_D2H, COPY_H2D)

#: the resource each device stream occupies: an op waits for the previous op on its resource.
#: Both copy streams share the host link as one serial resource (CPU offload's copies run
#: one after another whichever their direction, as measured with one pinned buffer at a time)
RESOURCE = {COMPUTE: COMPUTE, COPY_D2H: "link", COPY_H2D: "link", COMM: COMM}

#: CPU offload's ops (gobrrr.training.offload, costed by cost/_ops_offload.py), by op name
#: without its overload: the gradient's copy to the host, the parameter's copy back, the
#: optimizer's step on the CPU
OFFLOAD_STREAMS = {
    "gobrrr.offload_grad_d2h": COPY_D2H,
    "gobrrr.offload_param_h2d": COPY_H2D,
    "gobrrr.offload_cpu_step": HOST,
}


def stream_of(node: OpNode) -> str:
    """The stream `node` runs on: CPU offload's ops by their name (so graphs saved before
    `OpNode.stream` existed, and nodes a pass rebuilt field by field, still put them there),
    every other op where its node says."""
    stream = OFFLOAD_STREAMS.get(node.op) or OFFLOAD_STREAMS.get(node.op.rsplit(".", 1)[0])
    return stream or node.stream


@dataclass(frozen=True)
class Event:
    """A point on `stream`. `op` None: the work issued to `stream` so far (an event recorded
    on it when the waiting op is issued); an op index: that op's end on `stream` (its latest
    run, where it repeats)."""

    stream: str
    op: int | None = None


@dataclass(frozen=True)
class Wait:
    """`stream` waits for `event`: the host before it issues op `op` (or, `after`, once it
    has issued it: a sync); a device stream before it runs op `op`."""

    op: int
    stream: str
    event: Event
    after: bool = False
