"""`evaluate`: one step graph on one GPU -> its time and memory (an `Estimate`).

Everything that turns a graph into numbers goes through `evaluate`: `gobrrr estimate` (capture
and evaluate), `profile --compare`, the planner (which evaluates hundreds of graphs made by
passes from one trace) and the benchmarks. The GPU spec and its calibration are resolved once,
into a `Target`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gobrrr import formulas
from gobrrr.cost.roofline import Prediction, predict
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Calibration, GpuSpec, Target
from gobrrr.memory.replay import MemoryResult, module_rollup, step_memory


def evaluate(graph: StepGraph, target: str | GpuSpec | Target = "h100", *,
             compiled: bool | None = None, capture_s: float = 0.0) -> Estimate:
    """The step's memory (allocation replay through the caching allocator, against the
    memory CUDA leaves the process) and time (per-op roofline and the host/GPU schedule) on
    `target`. compiled: the model's forward and backward run under torch.compile; None =
    as the graph was captured (meta.compiled: `capture(compile=True)`, whose graph holds
    the compiled step's own tensors). True on an eager trace: the eager step's memory (an
    upper bound) with the compiled time model."""
    if compiled is None:
        compiled = bool(graph.meta.compiled)
    t = Target.resolve(target)
    return Estimate(graph=graph, gpu=t.gpu, memory=step_memory(graph, t.gpu, t.cal),
                    time=predict(graph, t.gpu, t.cal, compiled=compiled), cal=t.cal,
                    formulas=closed_forms(graph), capture_s=capture_s, compiled=compiled)


ESTIMATE_VERSION = 1

@dataclass(frozen=True)
class Estimate:
    """A predicted step: the graph it was computed from, its memory and its time."""

    graph: StepGraph = field(repr=False)
    gpu: GpuSpec
    memory: MemoryResult
    time: Prediction
    cal: Calibration | None  # the calibration used; None = datasheet peaks + default efficiencies
    formulas: dict[str, Any]
    capture_s: float
    compiled: bool = False

    @property
    def calibration(self) -> str | None:
        """The device name of the calibration used, if any."""
        return self.cal.device_name if self.cal else None

    @property
    def fits(self) -> bool:
        """The step runs on the GPU: the caching allocator's reserved peak stays within the
        memory CUDA leaves to the process (`gobrrr.memory.replay.process_budget`)."""
        return self.memory.fits()

    def to_dict(self, top: int = 15) -> dict[str, Any]:
        """JSON-ready summary (bytes, seconds, FLOP/s fractions). `top`: rows of the op and
        module lists (`ops` and `modules` say how many there are in all)."""
        t, m = self.time, self.memory
        ops = sorted(t.ops, key=lambda o: -o.device_s)
        modules = t.by_module()
        ckpt, recomputed = checkpointing(self.graph)
        return {
            "version": ESTIMATE_VERSION,
            "workload": {**{k: v for k, v in self.graph.meta.to_dict().items()
                            if k not in ("info", "assumptions", "autograd")},
                         "compiled": self.compiled, "checkpointing": ckpt,
                         "recomputed_ops": recomputed},
            "assumptions": list(self.graph.meta.assumptions or []),
            "gpu": {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes,
                    "calibration": self.calibration},
            "memory": {"peak_bytes": m.peak, "peak_rounded_bytes": m.peak_rounded,
                       "fits": self.fits, "reserved_bytes": m.reserved,
                       "budget_bytes": m.budget, "headroom_bytes": m.headroom,
                       "headroom_share": m.headroom_share, "oom_op_index": m.oom_index,
                       "segments": m.allocator.segments_peak if m.allocator else None,
                       "fragmentation_bytes": m.allocator.fragmentation if m.allocator else None,
                       "peak_op": m.peak_op,
                       "peak_module": m.peak_module, "peak_phase": m.peak_phase,
                       "at_peak": m.at_peak, "persistent": m.persistent,
                       "activations_saved_bytes": saved_activations(self.graph),
                       "at_peak_by_module": module_rollup(m.by_module)},
            "time": {"step_s": t.step_s, "device_s": t.device_s, "host_s": t.host_s,
                     "idle_s": t.idle_s, "clock_fraction": t.clock_fraction,
                     **self.throughput(), **self.utilization(),
                     "regime_share": t.regime_share(), "phase_s": t.phase_s,
                     "backward_forward_flops": t.backward_forward_ratio(),
                     "modules_s": dict(list(modules.items())[:top])},
            "top_ops": [{"index": o.index, "op": o.op, "module": o.module, "phase": o.phase,
                         "kind": o.kind, "device_s": o.device_s, "flops": o.flops,
                         "bytes": o.bytes, "regime": o.regime,
                         "intensity": o.intensity if o.intensity != float("inf") else None}
                        for o in ops[:top]],
            "formulas": self.formulas,
            "hints": hints(self),
            "ops": len(self.graph.nodes),
            "modules": len(modules),
            "capture_s": self.capture_s,
        }

    def throughput(self) -> dict[str, Any]:
        """Units per second in the workload's unit: tokens for sequences, samples otherwise."""
        unit = throughput_unit(self.graph)
        t = self.time
        out: dict[str, Any] = {"unit": unit, "units_per_step": t.tokens,
                               "per_s": t.tokens_per_s}
        if unit == "tokens":
            out["tokens_per_s"] = t.tokens_per_s
        return out

    def utilization(self) -> dict[str, Any]:
        """MFU and HFU against one peak (the precision's dense matmul peak), with their
        definitions; for sequence models also MFU by the 6·N + attention convention."""
        from gobrrr.cost.roofline import model_flops_6n

        t = self.time
        out: dict[str, Any] = {
            "mfu": t.mfu, "hfu": t.hfu, "flops": t.flops, "model_flops": t.model_flops,
            "peak_flops": t.peak_flops,
            "peak": f"dense {self.graph.meta.precision.peak_mode} matmul peak",
            "mfu_definition": MFU_DEFINITION, "hfu_definition": HFU_DEFINITION,
        }
        if self.graph.meta.seq_len and t.step_s > 0:
            flops_6n = model_flops_6n(self.graph)
            out["model_flops_6n_attention"] = flops_6n
            out["mfu_6n_attention"] = flops_6n / t.step_s / t.peak_flops
        return out


MFU_DEFINITION = ("model FLOPs: the traced forward and backward, without recomputation, per "
                  "second over the peak")
HFU_DEFINITION = "every FLOP the step runs (recompute, optimizer) per second over the peak"


def throughput_unit(graph: StepGraph) -> str:
    """"tokens" for a sequence workload (a seq_len, or its units counted from an integer
    (batch, sequence) input), else "samples"."""
    if graph.meta.seq_len:
        return "tokens"
    inputs = {s.id for s in graph.storages if s.kind == "input"}
    for n in graph.nodes:
        for t in n.inputs:
            if t.storage in inputs and t.dtype.startswith(("int", "uint")) and len(t.shape) >= 2:
                return "tokens" if t.numel == graph.meta.tokens else "samples"
    return "samples"


def checkpointing(graph: StepGraph) -> tuple[str, int]:
    """How the traced step checkpoints, seen in the graph (recomputed ops), and how many ops
    it recomputes: "full" (gobrrr's --checkpoint full), "model" (the model checkpoints
    itself, e.g. gradient_checkpointing_enable()) or "none"."""
    recomputed = sum(1 for n in graph.nodes if n.phase == "recompute")
    if graph.meta.checkpoint == "full":
        return "full", recomputed
    return ("model" if recomputed else "none"), recomputed


def hints(est: Estimate) -> list[str]:
    """What the prediction says to change, with the time it would save."""
    from gobrrr.cost.rates import Rates
    from gobrrr.cost.shapes import misaligned, misaligned_nt

    out = []
    slow = [o for o in est.time.ops if o.kind == "matmul" and o.device_s > 0
            and o.math not in ("fp32",) and misaligned(est.graph.nodes[o.index])]
    if slow:
        rates = Rates(est.gpu, est.cal)
        fracs = [rates.misaligned_fraction(o.math, misaligned_nt(est.graph.nodes[o.index]))
                 for o in slow]
        lo, hi = min(fracs), max(fracs)
        saved = sum(o.device_s * (1 - f) for o, f in zip(slow, fracs, strict=True))
        mods = sorted({o.module or "<top>" for o in slow})
        shapes = sorted({n for o in slow for t in est.graph.nodes[o.index].outputs
                         for n in t.shape if (n * t.itemsize) % 16})
        dims = _listed([str(n) for n in shapes], 3)
        out.append(f"{len(slow)} matmuls in {_listed(mods, 3)} have a dimension that is "
                   f"not a multiple of 16 bytes ({dims}): they run at "
                   f"{f'{lo:.0%}-{hi:.0%}' if hi - lo >= 0.005 else f'{lo:.0%}'} of the aligned "
                   "rate; padding it (e.g. a vocabulary to a multiple of 64) would save "
                   f"≈{saved * 1e3:.1f} ms per step")
    if not est.fits:
        cap, gib = est.memory.budget or est.gpu.memory_bytes, 2**30
        state = sum(est.memory.at_peak.get(k, 0) for k in ("parameter", "gradient",
                                                           "optimizer_state"))
        if state > cap:
            gpus = -(-state // cap)
            out.append(f"parameters, gradients and optimizer states alone need {state / gib:.1f}"
                       f" GiB of {cap / gib:.1f} GiB: shard them over ≥{gpus} GPUs (FSDP), keep"
                       " them in bf16 (--precision bf16) or offload the optimizer states to CPU")
        else:
            out.append(f"the step needs {est.memory.reserved / gib:.1f} GiB reserved of "
                       f"{cap / gib:.1f} GiB, mostly activations: try --checkpoint full or a "
                       "smaller --batch")
    return out


def _listed(items: list[str], n: int) -> str:
    """The first n items, and how many more there are."""
    more = f" and {len(items) - n} more (--json lists every op)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def saved_activations(graph: StepGraph) -> int:
    """Bytes created in forward and still alive when backward starts (saved for backward)."""
    from gobrrr.memory.replay import round_alloc

    return sum(round_alloc(s.nbytes) for s in graph.storages if s.kind == "activation")


def parameter_shapes(graph: StepGraph) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each parameter storage, shapes as the ops saw the whole tensor (a
    parameter no op read counts as one flat vector)."""
    whole: dict[int, tuple[int, ...]] = {}
    sizes = {s.id: s.nbytes for s in graph.storages if s.kind == "parameter"}
    for n in graph.nodes:
        for t in (*n.inputs, *n.outputs):
            if t.storage in sizes and t.storage not in whole and t.nbytes == sizes[t.storage]:
                whole[t.storage] = tuple(t.shape)
    return [(s.label, whole.get(s.id, (s.nbytes // 4,))) for s in graph.storages
            if s.kind == "parameter"]


def closed_forms(graph: StepGraph) -> dict[str, Any]:
    """The textbook numbers for a transformer, beside the traced ones."""
    info = graph.meta.info or {}
    if not all(k in info for k in ("layers", "hidden", "vocab", "heads")):
        return {}
    L, d, V, a = info["layers"], info["hidden"], info["vocab"], info["heads"]
    seq = graph.meta.seq_len or 0
    batch = (graph.meta.tokens or 0) // seq if seq else 0
    elem = graph.meta.precision.element_size
    out: dict[str, Any] = {
        "params_traced": graph.meta.params,
        "params_textbook_12d2L_2dV": formulas.textbook_params(L, d, V),
        "params_gap": [list(g) for g in formulas.textbook_param_gap(L, d, V,
                                                                     parameter_shapes(graph))],
    }
    if seq:
        out["activations_traced_bytes"] = saved_activations(graph)
        out["activations_lecture_bytes"] = batch * formulas.activation_bytes_per_sequence(
            L, d, seq, a, V, elem)
        recompute = "full" if graph.meta.checkpoint == "full" else "flash"
        out["activations_megatron_bytes"] = formulas.megatron_activation_bytes(
            seq, batch, d, a, L, recompute=recompute)
        out["megatron_variant"] = recompute
    return out
