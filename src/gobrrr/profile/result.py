"""What a measured step is: frozen dataclasses, serialized as versioned JSON (never pickle)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gobrrr.errors import GobrrrError

# 2: model FLOPs are the traced forward and backward (were 6·N + attention), HFU counts the
# traced step's FLOPs, throughput is in the workload's unit (`unit`, `units_per_step`, `per_s`)
RESULT_VERSION = 2


@dataclass(frozen=True)
class MeasuredOp:
    """One dispatch-level ATen op of the profiled step (or one compiled-region kernel).

    Times in seconds, rates in FLOP/s and bytes/s. `flops`/`bytes` come from the step graph's
    cost model when the op was joined to a node (`cost_source` "graph"), else from the shapes
    the profiler recorded ("shapes"). `roofline` is the fraction of the op's roofline time it
    achieved: max(flops / peak[math], bytes / bandwidth) / device_s (1.0 = on the roof).
    `regime`: the prediction's vocabulary (`OpTime.regime`), "compute" | "memory" |
    "overhead" | "none"; see profile.analyze for how a measured op is classified.
    """

    index: int
    op: str
    family: str
    kind: str
    phase: str
    module: str
    kernels: int
    kernel: str  # the longest kernel's name
    device_s: float
    host_s: float
    gap_s: float  # device idle right before the op's first kernel
    node: int = -1
    flops: float = 0.0
    bytes: float = 0.0
    math: str = ""
    cost_source: str = ""
    flops_per_s: float = 0.0
    bytes_per_s: float = 0.0
    roofline: float | None = None
    regime: str = "none"
    compiled: str = ""


@dataclass(frozen=True)
class GroupTime:
    """Measured time of a group of ops (a phase, a module, an op kind)."""

    name: str
    device_s: float
    share: float  # of the summed device time of all ops
    ops: int
    flops: float
    bytes: float
    flops_per_s: float
    bytes_per_s: float
    regime: str  # the regime holding most of the group's time


@dataclass(frozen=True)
class Finding:
    """One diagnosis item: what, how much time it would save (s), the evidence, the fix."""

    kind: str
    title: str
    saving_s: float
    evidence: str
    remedy: str
    memory_bytes: float = 0.0  # memory it would free, when that is the point


@dataclass(frozen=True)
class ProfileResult:
    """One workload measured on one device. Seconds, bytes, FLOPs, FLOP/s throughout.

    `step_s` is the median of the timed steps (CUDA events on a GPU, perf_counter on the
    CPU); the per-op figures come from one further step under torch.profiler, which runs a
    little slower than the timed ones (the profiler adds host time per op).

    MFU and HFU are defined as `gobrrr estimate` defines them: model FLOPs are those of the
    traced step's forward and backward without recomputation, HFU's FLOPs every op of the
    traced step, both per second of `step_s` over one peak (`peak`), so MFU <= HFU for every
    model. PaLM's 6·N + attention figure is kept apart (`*_6n_attention`).
    """

    workload: str
    device: str  # "cuda" | "cpu"
    device_name: str
    gpu: str  # spec name, "" when not a known GPU
    label: str  # e.g. "cpu: measured on the CPU, not a GPU"
    precision: str
    checkpoint: str
    compiled: bool
    steps: int
    warmup: int
    unit: str  # "tokens" for a sequence workload, else "samples"
    units_per_step: int
    step_s: float
    step_min_s: float
    step_max_s: float
    step_times: tuple[float, ...]
    per_s: float  # units_per_step / step_s: tokens/s or samples/s
    model_flops: float  # per step: the traced forward and backward, without recomputation
    executed_flops: float  # per step: every op of the traced step (recompute, optimizer too)
    flops_source: str  # "traced step graph", or why no FLOPs were counted
    peak_flops: float  # the precision's dense matmul peak, 0 on the CPU
    peak: str  # that peak in words, e.g. "dense bf16 matmul peak of h100-sxm"
    mfu: float | None  # model_flops / step_s / peak_flops; None without a peak
    hfu: float | None  # executed_flops / step_s / peak_flops; >= mfu
    model_flops_6n_attention: float | None  # PaLM's 6·N·T + attention; sequences only
    mfu_6n_attention: float | None  # MFU by that convention
    peak_allocated: int
    peak_reserved: int
    profiled_step_s: float  # device span of the profiled step (first kernel to last)
    busy_s: float  # union of kernel intervals in the profiled step
    idle_s: float  # step_s - busy_s: the GPU idle in a timed step
    idle_share: float  # idle_s / step_s
    kernels: int
    kernels_attributed: int
    graph_matched: float | None  # fraction of kernel-launching ops joined to a graph node
    ops: tuple[MeasuredOp, ...]
    phases: tuple[GroupTime, ...]
    modules: tuple[GroupTime, ...]
    kinds: tuple[GroupTime, ...]
    diagnosis: tuple[Finding, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = RESULT_VERSION

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second for a sequence workload, None for any other."""
        return self.per_s if self.unit == "tokens" else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        """Write atomically: a half-written result never exists on disk."""
        atomic_write_text(path, self.to_json())

    @staticmethod
    def from_json(text: str) -> ProfileResult:
        data = json.loads(text)
        if data.get("version") != RESULT_VERSION:
            raise GobrrrError(
                f"profile result has version {data.get('version')!r}, this gobrrr "
                f"reads {RESULT_VERSION}: profile again with this version"
            )
        data["step_times"] = tuple(data["step_times"])
        data["ops"] = tuple(MeasuredOp(**o) for o in data["ops"])
        for k in ("phases", "modules", "kinds"):
            data[k] = tuple(GroupTime(**g) for g in data[k])
        data["diagnosis"] = tuple(Finding(**f) for f in data["diagnosis"])
        names = {f.name for f in fields(ProfileResult)}
        return ProfileResult(**{k: v for k, v in data.items() if k in names})

    @staticmethod
    def load(path: str | Path) -> ProfileResult:
        try:
            return ProfileResult.from_json(Path(path).read_text())
        except OSError as e:
            raise GobrrrError(f"cannot read profile result {path}: {e.strerror}") from None


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temp file beside `path`, then rename; on any error (Ctrl-C included) the
    temp file is removed and `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
