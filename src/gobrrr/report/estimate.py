"""An `Estimate` as JSON-ready data (`gobrrr estimate --json`, the benchmarks' records)."""

from __future__ import annotations

from typing import Any

from gobrrr.evaluate import Estimate, checkpointing, saved_activations
from gobrrr.graph.ir import StepGraph
from gobrrr.memory.replay import module_rollup
from gobrrr.passes.loop import DESCRIBED, described, held, other
from gobrrr.report.advice import hints

ESTIMATE_VERSION = 1


def estimate_dict(est: Estimate, top: int = 15) -> dict[str, Any]:
    """`est` as JSON-ready data (bytes, seconds, FLOP/s fractions). `top`: rows of the op and
    module lists (`ops` and `modules` say how many there are in all)."""
    t, m = est.time, est.memory
    ops = sorted(t.ops, key=lambda o: -o.device_s)
    modules = t.by_module()
    ckpt, recomputed = checkpointing(est.graph)
    return {
        "version": ESTIMATE_VERSION,
        "workload": {
            **{
                k: v
                for k, v in est.graph.meta.to_dict().items()
                if k not in ("info", "assumptions", "autograd", "outputs")
            },
            "compiled": est.compiled,
            "checkpointing": ckpt,
            "recomputed_ops": recomputed,
        },
        "assumptions": list(est.graph.meta.assumptions or []),
        "trainable": est.trainable.to_dict(),
        "loop": loop_dict(est),
        "gpu": {
            "name": est.gpu.name,
            "memory_bytes": est.gpu.memory_bytes,
            "calibration": est.calibration,
            "memory_calibration": est.memory_calibration,
        },
        "memory": {
            "peak_bytes": m.peak,
            "peak_rounded_bytes": m.peak_rounded,
            "fits": est.fits,
            "reserved_bytes": m.reserved,
            "budget_bytes": m.budget,
            "headroom_bytes": m.headroom,
            "headroom_share": m.headroom_share,
            "oom_op_index": m.oom_index,
            "segments": m.allocator.segments_peak if m.allocator else None,
            "fragmentation_bytes": m.allocator.fragmentation if m.allocator else None,
            "peak_op": m.peak_op,
            "peak_module": m.peak_module,
            "peak_phase": m.peak_phase,
            "at_peak": m.at_peak,
            "persistent": m.persistent,
            "activations_saved_bytes": saved_activations(est.graph),
            "at_peak_by_module": module_rollup(m.by_module),
        },
        "time": {
            "step_s": t.step_s,
            "device_s": t.device_s,
            "host_s": t.host_s,
            "idle_s": t.idle_s,
            "clock_fraction": t.clock_fraction,
            **est.throughput(),
            **est.utilization(),
            "regime_share": t.regime_share(),
            "phase_s": t.phase_s,
            "backward_forward_flops": t.backward_forward_ratio(),
            "modules_s": dict(list(modules.items())[:top]),
        },
        "top_ops": [
            {
                "index": o.index,
                "op": o.op,
                "module": o.module,
                "phase": o.phase,
                "kind": o.kind,
                "device_s": o.device_s,
                "flops": o.flops,
                "bytes": o.bytes,
                "regime": o.regime,
                "intensity": o.intensity if o.intensity != float("inf") else None,
            }
            for o in ops[:top]
        ],
        **parallel_dict(est),
        "formulas": est.formulas,
        "hints": hints(est),
        "ops": len(est.graph.nodes),
        "modules": len(modules),
        "capture_s": est.capture_s,
    }


def loop_dict(est: Estimate) -> dict[str, Any]:
    """The training loop the memory assumes (`gobrrr.passes.loop`), the other loop's peak and
    the model outputs that make the difference (bytes)."""
    kind = est.graph.meta.loop_mode
    out: dict[str, Any] = {"assumes": kind, "line": loop_line(est)}
    alt, mem = other(kind), est.other_loop
    if alt is not None and mem is not None:
        sizes = {s.id: s.nbytes for s in est.graph.storages}
        out |= {
            "other": alt,
            "other_peak_bytes": mem.peak,
            "other_reserved_bytes": mem.reserved,
            "other_minus_this_bytes": mem.peak - est.memory.peak,
            "held": [
                {
                    "path": o.path,
                    "dtype": o.dtype,
                    "shape": list(o.shape),
                    "bytes": sizes[o.storage],
                }
                for o in held(est.graph)
            ],
        }
    return out


def loop_line(est: Estimate) -> str:
    """One line: the loop the memory assumes, and what the other would add or save."""
    kind = est.graph.meta.loop_mode
    line = f"memory for a training loop that {DESCRIBED[kind]}"
    alt, mem = other(kind), est.other_loop
    if alt is None or mem is None:
        return line
    diff = mem.peak - est.memory.peak
    sizes = {s.id: s.nbytes for s in est.graph.storages}
    what = described(held(est.graph), sizes)
    if not what:
        return f"{line}; the model returns nothing a loop could keep longer"
    size = _size(abs(diff))
    if kind == "zero-grad-first":  # the other loop (drops-output) frees both
        what = f"{what} and the last step's gradients"
    if alt == "keeps-output" and diff < 0:  # hf-trainer: its copy can outweigh the output
        return f"{line}; a loop that keeps it alive through backward peaks {size} lower: {what}"
    if alt == "keeps-output":
        return f"{line}; a loop that keeps it alive through backward holds +{size} more: {what}"
    return f"{line}; one that drops it before backward peaks {size} lower: {what}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def parallel_dict(est: Estimate) -> dict[str, Any]:
    """{"parallel": ...} for a data-parallel step (`meta.parallel`): the recipe, throughput
    per GPU and for the job, communication exposed and overlapped (s, per rank); {} for one
    GPU (its JSON unchanged)."""
    par, t = est.graph.meta.parallel, est.time
    if par is None:
        return {}
    return {
        "parallel": {
            "kind": par.kind,
            "gpus": par.world,
            "nodes": par.hosts,
            "tokens_per_s_per_gpu": t.tokens_per_s,
            "tokens_per_s_job": t.job_tokens_per_s,
            "comm_s": t.comm_s,
            "exposed_comm_s": t.exposed_comm_s,
            "overlapped_comm_s": t.overlapped_comm_s,
            "comm_by_collective": t.comm_by_collective,
            "per_rank_state": per_rank_state(est.graph),
        }
    }


#: the optimizers whose states are two moments of each parameter's elements (ZeRO's K = 8 of
#: fp32 AdamW's bytes per element)
TWO_MOMENTS = ("Adam", "AdamW")


def per_rank_state(graph: StepGraph) -> dict[str, Any] | None:
    """One rank's parameters, gradients (those the optimizer steps with) and optimizer states
    in bytes, as the step graph holds them (exact: before the allocator rounds each block),
    beside ZeRO's closed forms from the model's parameter elements Psi (`meta.params`; the
    trainable ones for gradients and states): FSDP2 and HSDP (ZeRO-3) Psi x 4/N, 4/N, 8/N with
    N the ranks a parameter is sharded over (all of them; one node's under HSDP), fp32 shards
    and AdamW's two fp32 moments; DDP (replicated) 4, 4 and 8 bytes an element (2, 2 and 4
    traced in pure bf16). The graph's figures exceed the closed forms by FSDP2's dim-0 padding
    (ceil(d0 / N) rows a parameter). None for one GPU; the states' closed form None for an
    optimizer that is not Adam or AdamW."""
    meta = graph.meta
    par = meta.parallel
    if par is None:
        return None
    by_id = {s.id: s for s in graph.storages}
    stepped = {
        t.storage
        for n in graph.nodes
        if n.phase == "optimizer"
        for t in n.inputs
        if by_id[t.storage].kind == "gradient"
    }
    held = {
        "parameters_bytes": sum(s.nbytes for s in graph.storages if s.kind == "parameter"),
        "gradients_bytes": sum(by_id[i].nbytes for i in stepped),
        "optimizer_states_bytes": sum(
            s.nbytes for s in graph.storages if s.kind == "optimizer_state"
        ),
    }
    if par.kind == "ddp":
        n, rule, width = 1, "replicated", 2 if meta.precision.name == "bf16" else 4
    else:
        n, rule, width = (par.per_host if par.kind == "hsdp" else par.world), "ZeRO-3", 4
    adam = meta.optimizer is not None and meta.optimizer.key.split(":")[0] in TWO_MOMENTS
    trainable = meta.trainable_params or meta.params
    closed = {
        "parameters_bytes": meta.params * width / n,
        "gradients_bytes": trainable * width / n,
        "optimizer_states_bytes": trainable * 2 * width / n if adam else None,
    }
    return {"rule": rule, "shards": n, "bytes_per_element": width, **held, "closed_form": closed}
