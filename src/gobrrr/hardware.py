"""GPU specs (dense datasheet peaks, never the 2:4-sparsity figures) and calibrations.

A GpuSpec says what the chip can do on paper; a Calibration says what one was measured to
achieve (matmul FLOP/s, copy bandwidth, per-kernel launch overhead). The cost model uses a
calibration when one exists for the target GPU and the spec with default efficiencies
otherwise.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import tomllib
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gobrrr.errors import GobrrrError, did_you_mean

log = logging.getLogger(__name__)

TF = 1e12
GB = 1e9
GiB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model.

    Fields:
        name: canonical key, e.g. "h100-sxm".
        full_name: what `torch.cuda.get_device_name()` prints on one, for matching.
        memory_bytes: usable device memory in bytes.
        bandwidth: HBM bandwidth in bytes/s (datasheet).
        peak_flops: dense FLOP/s per math mode: "fp32" (CUDA cores), "tf32", "bf16",
            "fp16", "fp8" (tensor cores).
        sms: streaming multiprocessors, for wave quantization of matmuls.
        launch_overhead: seconds of host time per eager kernel launch (dispatch + launch).
        kernel_latency: seconds of device time a kernel costs however small it is.
        blas_workspace: bytes the cuBLAS handle keeps allocated (counts in max_memory_allocated).
        blaslt_workspace: bytes cuBLASLt keeps allocated once an addmm with a bias ran.
        matmul_efficiency / bandwidth_efficiency: achievable fraction of peak when no
            calibration exists (large, well-shaped problems).
        aliases: other names users type.
        chip: the GPU die ("GH100"); with `sms`, what cuDNN's and cuBLAS's choices of kernel,
            and so their workspaces, go by (`memory_calibration`). "" where not known.
    """

    name: str
    full_name: str
    memory_bytes: int
    bandwidth: float
    peak_flops: dict[str, float]
    sms: int
    launch_overhead: float = 10e-6
    kernel_latency: float = 2.5e-6
    blas_workspace: int = 8 * 1024**2 + 128 * 1024
    blaslt_workspace: int = 1024**2
    matmul_efficiency: float = 0.80
    bandwidth_efficiency: float = 0.88
    aliases: tuple[str, ...] = ()
    chip: str = ""

    @property
    def fp8_tensor_cores(self) -> bool:
        """Whether the GPU has FP8 tensor cores (Ada, Hopper, Blackwell: L4, L40S, RTX 4090,
        H100, H200, B200), i.e. an FP8 dense peak in its spec; A100, V100 and T4 have none."""
        return "fp8" in self.peak_flops

    @property
    def ridge_point(self) -> float:
        """FLOP/byte above which a bf16 tensor-core op is compute-bound."""
        return self.peak_flops["bf16"] / self.bandwidth

    def peak(self, mode: str) -> float:
        """Dense peak FLOP/s for a math mode; fp32 falls back to the CUDA-core rate."""
        if mode not in self.peak_flops:
            raise GobrrrError(
                f"GPU {self.name} has no peak for {mode!r}; "
                f"known: {', '.join(sorted(self.peak_flops))}"
            )
        return self.peak_flops[mode]


def _spec(name, full, mem_gib, bw_gbs, fp32, tf32, bf16, fp8, sms, **kw) -> GpuSpec:
    peaks = {"fp32": fp32 * TF, "tf32": tf32 * TF, "bf16": bf16 * TF, "fp16": bf16 * TF}
    if fp8:
        peaks["fp8"] = fp8 * TF
    return GpuSpec(
        name=name,
        full_name=full,
        memory_bytes=int(mem_gib * GiB),
        bandwidth=bw_gbs * GB,
        peak_flops=peaks,
        sms=sms,
        **kw,
    )


_HOPPER_WS = 32 * 1024**2  # cuBLAS workspace default on sm90+: 4096 KiB x 8

BUILTIN_GPUS: tuple[GpuSpec, ...] = (
    _spec(
        "a100-40gb",
        "NVIDIA A100-SXM4-40GB",
        39.39,
        1555,
        19.5,
        156,
        312,
        None,
        108,
        aliases=("a100-40",),
        chip="GA100",
    ),
    _spec(
        "a100-80gb",
        "NVIDIA A100-SXM4-80GB",
        79.15,
        2039,
        19.5,
        156,
        312,
        None,
        108,
        aliases=("a100", "a100-80"),
        chip="GA100",
    ),
    _spec(
        "h100-sxm",
        "NVIDIA H100 80GB HBM3",
        79.65,
        3350,
        66.9,
        494.7,
        989.4,
        1978.9,
        132,
        blas_workspace=_HOPPER_WS,
        blaslt_workspace=_HOPPER_WS,
        aliases=("h100", "h100-80gb"),
        chip="GH100",
    ),
    _spec(
        "h100-pcie",
        "NVIDIA H100 PCIe",
        79.65,
        2000,
        51.2,
        378,
        756.5,
        1513,
        114,
        blas_workspace=_HOPPER_WS,
        blaslt_workspace=_HOPPER_WS,
        chip="GH100",
    ),
    _spec(
        "h200",
        "NVIDIA H200",
        140.4,
        4800,
        66.9,
        494.7,
        989.4,
        1978.9,
        132,
        blas_workspace=_HOPPER_WS,
        blaslt_workspace=_HOPPER_WS,
        aliases=("h200-sxm",),
        chip="GH100",
    ),
    _spec(
        "b200",
        "NVIDIA B200",
        178.4,
        8000,
        75,
        1100,
        2250,
        4500,
        148,
        blas_workspace=_HOPPER_WS,
        blaslt_workspace=_HOPPER_WS,
        chip="GB100",
    ),
    _spec("l4", "NVIDIA L4", 22.5, 300, 30.3, 60, 121, 242, 58, chip="AD104"),
    _spec("l40s", "NVIDIA L40S", 44.5, 864, 91.6, 183, 362, 733, 142, chip="AD102"),
    _spec(
        "rtx4090",
        "NVIDIA GeForce RTX 4090",
        23.6,
        1008,
        82.6,
        82.6,
        165.2,
        330.3,
        128,
        aliases=("4090", "rtx-4090"),
        chip="AD102",
    ),
)


def gpu_names() -> list[str]:
    return [g.name for g in BUILTIN_GPUS]


def get_gpu(name: str) -> GpuSpec:
    """A built-in GPU by name or alias, a user's own from a .toml/.json file path, or the
    built-in whose full name is the CUDA device name given (`torch.cuda.get_device_name()`).
    Use `Target.resolve` to get its calibration with it."""
    key = name.strip().lower()
    for g in BUILTIN_GPUS:
        if key == g.name or key in g.aliases:
            return g
    if key.endswith((".toml", ".json")):
        return load_gpu_file(name)
    if (g := match_device_name(name)) is not None:
        return g
    names = ", ".join(gpu_names())
    if Path(name).is_dir():
        raise GobrrrError(
            f"GPU spec {name} is a directory",
            hint="give a .toml or .json GPU spec file, or a built-in GPU name",
        )
    if Path(name).exists():
        raise GobrrrError(
            f"GPU spec file {name} must end in .toml or .json",
            hint=f"rename it, or choose a built-in GPU: {names}",
        )
    known = [*gpu_names(), *(a for g in BUILTIN_GPUS for a in g.aliases)]
    raise GobrrrError(
        f"unknown GPU {name!r}{did_you_mean(name, known)}",
        hint=f"choose one of {names} (`gobrrr gpus` lists them), or give a .toml/.json spec file",
    )


def match_device_name(device_name: str) -> GpuSpec | None:
    """The built-in spec whose full name is what CUDA reports, if any."""
    for g in BUILTIN_GPUS:
        if g.full_name.lower() == device_name.lower():
            return g
    for g in BUILTIN_GPUS:  # looser: "NVIDIA H100 80GB HBM3" vs variants
        if g.full_name.lower() in device_name.lower():
            return g
    return None


def load_gpu_file(path: str | Path) -> GpuSpec:
    """A user's GPU from TOML or JSON with keys: name, memory_gb, bandwidth_gbs, bf16_tflops,
    and optionally full_name, fp16_tflops, tf32_tflops, fp32_tflops, fp8_tflops, sms,
    launch_overhead_us (the schema: `SPEC_KEYS`). Every error names the file, the key and the
    form expected."""
    data = read_spec_file(path)
    bf16 = data["bf16_tflops"]
    peaks = {
        "bf16": bf16 * TF,
        "fp16": data.get("fp16_tflops", bf16) * TF,
        "tf32": data.get("tf32_tflops", bf16 / 2) * TF,
        "fp32": data.get("fp32_tflops", bf16 / 15) * TF,
    }
    if "fp8_tflops" in data:
        peaks["fp8"] = data["fp8_tflops"] * TF
    return GpuSpec(
        name=data["name"],
        full_name=data.get("full_name", data["name"]),
        memory_bytes=int(data["memory_gb"] * GB),
        bandwidth=data["bandwidth_gbs"] * GB,
        peak_flops=peaks,
        sms=data.get("sms", 100),
        launch_overhead=data.get("launch_overhead_us", 10.0) * 1e-6,
    )


# -- a user's GPU spec file -----------------------------------------------------------------


@dataclass(frozen=True)
class SpecKey:
    """One key of a GPU spec file: its type ("text", "number": finite and > 0, "count": a
    whole number > 0), whether it must be there, and what it means (with its unit)."""

    key: str
    type: str
    required: bool
    doc: str


SPEC_KEYS: tuple[SpecKey, ...] = (
    SpecKey("name", "text", True, "name reports show"),
    SpecKey("memory_gb", "number", True, "device memory in GB of 1e9 bytes"),
    SpecKey("bandwidth_gbs", "number", True, "memory bandwidth in GB/s"),
    SpecKey("bf16_tflops", "number", True, "dense bf16 tensor-core peak in TFLOP/s"),
    SpecKey("full_name", "text", False, "name CUDA reports, default the name"),
    SpecKey("fp16_tflops", "number", False, "dense fp16 peak in TFLOP/s, default bf16's"),
    SpecKey("tf32_tflops", "number", False, "dense tf32 peak in TFLOP/s, default bf16/2"),
    SpecKey("fp32_tflops", "number", False, "fp32 CUDA-core peak in TFLOP/s, default bf16/15"),
    SpecKey("fp8_tflops", "number", False, "dense fp8 peak in TFLOP/s"),
    SpecKey("sms", "count", False, "number of streaming multiprocessors, default 100"),
    SpecKey("launch_overhead_us", "number", False, "host time per kernel launch in µs, default 10"),
)
_FORMS = {
    "text": 'a quoted string, e.g. "mygpu"',
    "number": "a finite number > 0, e.g. 80",
    "count": "a whole number > 0, e.g. 132",
}


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """The validated keys of a GPU spec file (TOML or JSON) as Python values: text as str,
    numbers as float, counts as int. Raises GobrrrError naming the file, the key and the
    expected form for anything else (a missing or unknown key, a wrong type, a boolean, NaN,
    infinity, a number <= 0, a directory or an unreadable file)."""
    data = _parse_spec(Path(path))
    keys = {k.key: k for k in SPEC_KEYS}
    for k in data:
        if k not in keys:
            raise GobrrrError(
                f"GPU spec file {path}: unknown key {k!r}{did_you_mean(k, keys)}",
                hint=f"the keys are {', '.join(keys)}",
            )
    missing = [k.key for k in SPEC_KEYS if k.required and k.key not in data]
    if missing:
        raise GobrrrError(
            f"GPU spec file {path} lacks {', '.join(missing)}",
            hint="add " + "; ".join(f"{k}, the {keys[k].doc}" for k in missing),
        )
    return {k: _spec_value(path, keys[k], v) for k, v in data.items()}


def _parse_spec(p: Path) -> dict[str, Any]:
    if p.is_dir():
        raise GobrrrError(
            f"GPU spec file {p} is a directory",
            hint="give the path of the .toml or .json file itself",
        )
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise GobrrrError(
            f"cannot read GPU spec file {p}: {e.strerror}",
            hint="check the path (a .toml or .json file)",
        ) from None
    kind = "TOML" if p.suffix.lower() == ".toml" else "JSON"
    try:
        text = raw.decode()
        data = tomllib.loads(text) if kind == "TOML" else json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise GobrrrError(
            f"GPU spec file {p} is not valid {kind} ({e})",
            hint=f"write it as {kind} with keys name, memory_gb, bandwidth_gbs, bf16_tflops",
        ) from None
    if not isinstance(data, dict):
        raise GobrrrError(
            f"GPU spec file {p} holds a {type(data).__name__}, not a table of keys",
            hint='write {"name": "mygpu", "memory_gb": 80, ...}',
        )
    return data


def _spec_value(path: str | Path, spec: SpecKey, v: Any) -> Any:
    """One value checked against its key's type; bool is not a number, NaN and infinity are
    not finite, and numbers must be > 0."""
    form = f"give {spec.key} as {_FORMS[spec.type]} (the {spec.doc})"
    bad = f"GPU spec file {path}: {spec.key} is {v!r}"
    if spec.type == "text":
        if isinstance(v, str) and v.strip():
            return v
        raise GobrrrError(bad, hint=form)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise GobrrrError(
            f"{bad}, a {type(v).__name__}, not a number",
            hint=form.replace(", e.g.", " without quotes or units, e.g.", 1),
        )
    if not math.isfinite(v) or v <= 0:
        raise GobrrrError(bad, hint=form)
    if spec.type == "count" and v != int(v):
        raise GobrrrError(bad, hint=form)
    return int(v) if spec.type == "count" else float(v)


# -- calibration ----------------------------------------------------------------------------

CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """What one GPU was measured to achieve. FLOP/s and bytes/s are achieved rates on large
    problems; `matmul_curve` maps a matmul's FLOPs to its achieved fraction of the large-shape
    rate (small matmuls do not fill the chip), as sorted [flops, fraction] pairs.
    `matmul_misaligned`: fraction of the aligned rate with an odd leading dimension, per math
    mode. `attention_flops`: fwd+bwd FLOP/s of the default SDPA backend per dtype;
    `attention_curve`: the same over sequence lengths, [[S, FLOP/s], ...] per dtype.
    `matmul_grid`: achieved FLOP/s over output size and depth, [[m·n, k, FLOP/s], ...] per
    math mode (replaces `matmul_curve` where present); "fp8": torch._scaled_mm with tensorwise
    scales (`calibrate.sections.fp8`), on GPUs with FP8 tensor cores.
    `op_overhead`: host seconds per ATen op inside an eager training step, per phase
    ("recompute": a recomputed op; "checkpointed": a forward op inside a checkpointed block;
    both carry the checkpoint machinery and fall back to the forward's when absent).
    `op_bandwidth`: achieved bytes/s of ops whose kernels fall far from a copy's, by op name.
    `conv_grid`: achieved FLOP/s of cuDNN convolutions per math mode, over implicit-GEMM
    output size and depth, as [[outputs, depth, FLOP/s], ...], keyed "layout:class:direction"
    (layout "channels_first" | "channels_last"; class "1x1", "1x1-reduce", "1x1-expand",
    "3x3", "3x3-s2", "stem", "grouped"; direction "forward", "backward_input",
    "backward_weight"), or in calibrations before layouts "forward" | "backward"
    (channels-first, both gradients). `conv_workspace`: the bytes cuDNN allocates inside a
    convolution beyond its 16-bit layout copies, as a fraction of the op's input + output
    bytes, per math mode and direction ("forward" | "backward", channels-first; prefixed
    "channels_last:" for that layout), the median over the same grid.
    `batch_norm_bandwidth`: achieved bytes/s of training-mode batch norm over the channel
    count, {"forward:bf16" | "backward:fp32" | ... (channels-first), with ":channels_last"
    for that layout: [[channels, bytes/s], ...]}.
    `depthwise_bandwidth`: achieved bytes/s of depthwise convolutions over their channels
    and size in bytes, [[channels, bytes, bytes/s], ...] (over the size alone, [[bytes,
    bytes/s], ...], in calibrations that measured one channel count), keyed
    "forward:bf16:channels_last:5x5-s2" (direction, dtype, layout, kernel), or
    "forward:bf16" (channels-first 3x3) in calibrations before layouts.
    `op_host`: host seconds per call beyond an ordinary op's, keyed "op:dtype" (cuDNN
    convolutions and batch norm).
    `kernel_host`: host seconds per call of gobrrr's own kernel ops as a training step calls
    them, by op name ("rms_norm_fwd", ...), in place of an ordinary op's.
    `outer_sum_bandwidth`: achieved bytes/s of a sum over a tensor's leading dims (a bias
    gradient) over its output size and the rows it sums, {"sum:bf16" | "sum:fp32":
    [[outputs, rows, bytes/s], ...]} (or [[outputs, bytes/s], ...], one row count).
    `layer_norm_grid`: bytes/s of native_layer_norm(_backward) over width and rows, per input
    dtype, {"<op>:<fp32|bf16>": [[width, rows, bytes/s], ...]}; read before `op_bandwidth`.
    `embedding_backward`: embedding_dense_backward's time as fill + tokens + fixed,
    {"fill_Bps", "token_values_per_s", "fixed_s", "points"}
    (`calibrate_step.embedding_backward_fit`).
    `size_bandwidth`: achieved bytes/s of copies (dtype casts) and pointwise kernels over the
    bytes they move, less the kernel latency, {"copy" | "pointwise": [[bytes, bytes/s], ...]}.
    `matmul_misaligned` may also hold fractions by alignment, "<mode>@<bytes>" (2, 4, 8).
    `batch_norm_grid`: batch norm's bytes/s over channels and rows (N·H·W), keyed as
    `batch_norm_bandwidth`, [[channels, rows, bytes/s], ...]; read before that curve.
    `optim8`: torchao's 8-bit AdamW per parameter update (profile.calibrate_optim): "device"
    [[bytes, seconds], ...], "host" seconds, "kernels", "transient" and the measured grid.
    `offload`: CPU offload of the optimizer (gobrrr.calibrate.sections.offload): "d2h" and
    "h2d" pinned-copy bytes/s over sizes, [[bytes, bytes/s], ...]; "adamw:fp32" and
    "adamw:bf16", seconds of one fused AdamW step on the host's CPU over parameter sizes,
    [[elements, seconds], ...]; "d2h_issue_s", "h2d_issue_s", host seconds to queue one copy;
    "threads", the CPU threads torch used. Empty: not measured (offload is not planned).
    `path_bandwidth`: bytes/s of elementwise kernels by the path they take
    (`cost.shapes.elementwise_path`), over the bytes they move less the kernel latency,
    {"<copy|pointwise>:<path>": [[bytes, bytes/s], ...]}, and of torch's `_foreach_*` list
    kernels over the lists' bytes, "foreach" (`profile.calibrate_paths`).
    `softmax_grid`: bytes/s of _log_softmax, _softmax and their backwards over the row width
    and the rows, {"<op>:<bf16|fp32>": [[width, rows, bytes/s], ...]}.
    `optimizer_host`: host seconds to issue a whole optimizer step (and zero_grad) over its
    number of parameter tensors, by parameter size, {"AdamW:foreach" | ...: {"<elements>":
    [[tensors, seconds], ...]}} (`profile.calibrate_host.optimizer_host`).
    `power_duty`: the power limit's hold on compute-bound kernels, {"bf16": [[duty, fraction],
    ...]}: bf16 matmuls' achieved share of their burst rate (the rate every compute curve
    above is measured at) when they take `duty` of the GPU's time, in a steady pattern with
    memory-bound copies; "copy": the copies' share of theirs (`profile.calibrate_power`).
    Empty: not measured (compute runs at the burst rates).
    `collectives`: NCCL's collectives measured on this GPU's host, a list of points {"op":
    "all_reduce" | "all_gather" | "reduce_scatter", "dtype": "bf16" | "fp32", "bytes" (the
    whole buffer), "ranks", "seconds", ...} (`gobrrr.calibrate.sections.collectives`; read
    by `cost.collectives.curves_from_measurement`). Empty: not measured (the link's datasheet
    bandwidth).
    `dp_host`: the host time FSDP2's hooks add per unit, {"points": [{"ranks", "reshard",
    "phase": "forward" | "backward", "params" (the unit's parameter tensors), "seconds"},
    ...], "meta"} (`gobrrr.calibrate.sections.dp_host`; read by `cost.dp_host`). Empty: not
    measured (the hooks cost the host nothing beyond the ops they run).
    `contention`: what a resident NCCL collective and the compute kernels beside it cost each
    other, a list of points {"op", "dtype", "bytes", "ranks", "kernel", "class": "matmul" |
    "memory" | "attention", "kernel_alone_s", "kernel_beside_s", "collective_alone_s",
    "collective_beside_s"} (`gobrrr.calibrate.sections.contention`; read by
    `cost.contention`). Empty: not measured (each costed as if alone).
    `rnn_grid`: cuDNN's fused LSTM / GRU, forward and backward, keyed by the dtype cuDNN ran
    ("fp16" for an fp32 module under autocast, which PyTorch's RNN autocast always runs in
    fp16; "bf16"; "fp32") and, where it measured them, the host's issue time and whether the
    GPU qualifies for cuDNN's persistent kernel: {"<lstm|gru>:<forward|backward>:<dtype>":
    [[hidden, batch, layers, steps, seconds], ...], ...}, and "reserve:<mode>:<dtype>" the
    reserve space's measured bytes per (layer, step, sequence, hidden unit)
    (`gobrrr.calibrate.sections.rnn`; read by `cost.measured_ops`). A grid without fp16 keys
    (measured before they existed) is read at its bf16 points. Empty: not measured (the
    roofline at one step's GEMM).
    `pixel_grid`: bilinear upsampling and its atomicAdd backward, log-softmax over the
    channels of (N, C, H, W) and nll_loss2d, {"<op>:<bf16|fp32>": [[size, second coordinate,
    size per second], ...]} (`gobrrr.calibrate.sections.pixels`). Empty: not measured.
    `pool_grid`: avg_pool2d, max_pool2d_with_indices and their backwards per window, dtype and
    layout, {"<op>:k<kernel>s<stride>p<padding>:<bf16|fp32>:<layout>": [[map bytes, map
    bytes per second, side, channels, batch], ...]} (`gobrrr.calibrate.sections.pools`; read
    by `cost.measured_ops`). Empty: not measured (bytes at the reduction bandwidth).
    `cudagraph`: a CUDA graph's replay, fitted over chains of N captured kernels
    (`gobrrr.calibrate.sections.cudagraph`): "launch_host_s" + "node_host_s" x N, host
    seconds of one `graph.replay()`; "node_device_s", device seconds each captured kernel
    costs beyond its own work (in place of `kernel_latency`), "launch_device_s" once per
    replay; "points", the measured chains. Empty: not measured (CUDA graphs not planned)."""

    gpu: str
    device_name: str
    matmul_flops: dict[str, float]
    copy_bandwidth: float
    pointwise_bandwidth: float
    reduction_bandwidth: float
    launch_overhead: float
    kernel_latency: float
    blas_workspace: int | None = None
    blaslt_workspace: int | None = None
    matmul_misaligned: dict[str, float] = field(default_factory=dict)
    attention_flops: dict[str, float] = field(default_factory=dict)
    attention_curve: dict[str, list[list[float]]] = field(default_factory=dict)
    matmul_grid: dict[str, list[list[float]]] = field(default_factory=dict)
    op_overhead: dict[str, float] = field(default_factory=dict)
    op_bandwidth: dict[str, float] = field(default_factory=dict)
    matmul_curve: dict[str, list[list[float]]] = field(default_factory=dict)
    conv_grid: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    conv_workspace: dict[str, dict[str, float]] = field(default_factory=dict)
    batch_norm_bandwidth: dict[str, list[list[float]]] = field(default_factory=dict)
    depthwise_bandwidth: dict[str, list[list[float]]] = field(default_factory=dict)
    op_host: dict[str, float] = field(default_factory=dict)
    kernel_host: dict[str, float] = field(default_factory=dict)
    outer_sum_bandwidth: dict[str, list[list[float]]] = field(default_factory=dict)
    size_bandwidth: dict[str, list[list[float]]] = field(default_factory=dict)
    embedding_backward: dict[str, Any] = field(default_factory=dict)
    layer_norm_grid: dict[str, list[list[float]]] = field(default_factory=dict)
    batch_norm_grid: dict[str, list[list[float]]] = field(default_factory=dict)
    optim8: dict[str, Any] = field(default_factory=dict)
    offload: dict[str, Any] = field(default_factory=dict)
    path_bandwidth: dict[str, list[list[float]]] = field(default_factory=dict)
    softmax_grid: dict[str, list[list[float]]] = field(default_factory=dict)
    optimizer_host: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    power_duty: dict[str, list[list[float]]] = field(default_factory=dict)
    collectives: list[dict[str, Any]] = field(default_factory=list)
    dp_host: dict[str, Any] = field(default_factory=dict)
    contention: list[dict[str, Any]] = field(default_factory=list)
    rnn_grid: dict[str, list[list[float]]] = field(default_factory=dict)
    pixel_grid: dict[str, list[list[float]]] = field(default_factory=dict)
    pool_grid: dict[str, list[list[float]]] = field(default_factory=dict)
    cudagraph: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = CALIBRATION_VERSION
    #: sections this gobrrr does not know (a newer one wrote them): kept as read and written
    #: back by `save`, so a newer file survives an older reader's round trip
    unknown_sections: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def device_memory(self) -> int | None:
        """The device memory CUDA reported where this calibration was measured (bytes)."""
        return self.meta.get("memory")

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object: every known field, then the unknown sections as read."""
        out = asdict(self)
        extra = out.pop("unknown_sections")
        if not out["cudagraph"]:  # as files wrote it before the section existed
            del out["cudagraph"]
        if not out["pool_grid"]:
            del out["pool_grid"]
        return {**out, **{k: v for k, v in extra.items() if k not in out}}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        tmp.replace(path)

    @staticmethod
    def load(path: str | Path) -> Calibration:
        """A calibration file. Sections this version does not know are kept (a debug note
        names them); an unreadable, truncated or non-JSON file, a wrong version, a missing
        required field or a known field of the wrong type raise one GobrrrError naming the
        file, the field and the fix."""
        data = _read_calibration(Path(path))
        if data.get("version") != CALIBRATION_VERSION:
            raise GobrrrError(
                f"calibration {path} has version {data.get('version')!r}, "
                f"expected {CALIBRATION_VERSION}",
                hint=_RECALIBRATE,
            )
        hints = _calibration_fields()
        known = {k: v for k, v in data.items() if k in hints and k != "unknown_sections"}
        unknown = {k: v for k, v in data.items() if k not in known}
        if unknown:
            log.debug(
                "calibration %s: keeping sections this gobrrr does not read: %s",
                path,
                ", ".join(unknown),
            )
        missing = [
            f.name
            for f in fields(Calibration)
            if f.name not in known and f.default is MISSING and f.default_factory is MISSING
        ]
        if missing:
            raise GobrrrError(f"calibration {path} lacks {', '.join(missing)}", hint=_RECALIBRATE)
        for k, v in known.items():
            if not _is_a(v, hints[k]):
                raise GobrrrError(
                    f"calibration {path}: {k} is {_brief(v)}, not {_type_name(hints[k])}",
                    hint=_RECALIBRATE,
                )
        return Calibration(**known, unknown_sections=unknown)


_RECALIBRATE = (
    "run `gobrrr calibrate` on that GPU again, or restore the file (delete it to use the datasheet)"
)


def _read_calibration(p: Path) -> dict[str, Any]:
    """The JSON object of a calibration file, or a GobrrrError naming the file and the fix."""
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise GobrrrError(f"cannot read calibration {p}: {why}", hint=_RECALIBRATE) from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise GobrrrError(
            f"calibration {p} is not valid JSON (truncated or damaged: {e})", hint=_RECALIBRATE
        ) from None
    if not isinstance(data, dict):
        raise GobrrrError(
            f"calibration {p} holds a {type(data).__name__}, not a JSON object", hint=_RECALIBRATE
        )
    return data


@functools.cache
def _calibration_fields() -> dict[str, Any]:
    return typing.get_type_hints(Calibration)


def _is_a(v: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's type: dicts and lists element by element, ints
    count as floats, a bool is no number, Any takes anything."""
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_is_a(v, a) for a in args)
    if origin is dict:
        return isinstance(v, dict) and all(
            isinstance(k, str) and _is_a(x, args[1]) for k, x in v.items()
        )
    if origin is list:
        return isinstance(v, list) and all(_is_a(x, args[0]) for x in v)
    if hint is type(None):
        return v is None
    if hint is float:
        return isinstance(v, int | float) and not isinstance(v, bool)
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, hint)


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "")


def _brief(v: Any) -> str:
    text = repr(v)
    return f"a {type(v).__name__} ({text[:40]}{'...' if len(text) > 40 else ''})"


def calibration_dirs() -> list[Path]:
    """Where calibrations are looked for: the user's, then the ones shipped with gobrrr."""
    user = Path(os.environ.get("GOBRRR_HOME", Path.home() / ".cache" / "gobrrr")) / "calibration"
    return [user, Path(__file__).parent / "data" / "calibration"]


def find_calibration(gpu: GpuSpec) -> Calibration | None:
    """The saved calibration of `gpu` (the user's first, then the shipped one), or None. A
    damaged file raises GobrrrError naming it (see Calibration.load)."""
    for d in calibration_dirs():
        p = d / f"{gpu.name}.json"
        if p.exists():
            return Calibration.load(p)
    return None


def memory_calibration(gpu: GpuSpec, cal: Calibration | None) -> Calibration | None:
    """The calibration a step's memory on `gpu` reads its tables from (the BLAS workspaces,
    cuDNN's workspace per convolution class: `memory.replay.step_memory`): `cal` where given;
    else, for a GPU with no calibration, the saved or shipped one of a built-in GPU of the
    same chip and SM count (an H200 reads the H100 SXM's: one GH100 die, 132 SMs). The
    workspaces follow the kernels the libraries pick, which go by the device's architecture
    and SM count: the zoo measured on H200s is predicted from the H100 SXM's tables within
    0.01% at the median, 96 loop rows (tests/fixtures/loops_zoo_h200.json). Not every choice
    is the same on both (Inductor's pad_mm, which times its candidates on the device, pads a
    matmul on the H200 that it leaves on the H100: docs/investigations/2026-11-28-compiled-
    gpt2-plain-loop-peak.md). Only memory reads it (`Target.memory_cal`): the time model and
    the memory budget stay the GPU's own."""
    if cal is not None or not gpu.chip:
        return cal
    for other in BUILTIN_GPUS:
        if other.name != gpu.name and (other.chip, other.sms) == (gpu.chip, gpu.sms):
            found = find_calibration(other)
            if found is not None:
                return found
    return None


@dataclass(frozen=True)
class Target:
    """The GPU a graph is evaluated on: its spec and the calibration its rates come from
    (None = the datasheet peaks with default efficiencies). memory_cal: the calibration the
    memory replay reads its workspace tables from where it is not `cal` (a GPU without a
    calibration reads its chip's: `memory_calibration`, resolved once here); None = `cal`'s."""

    gpu: GpuSpec
    cal: Calibration | None
    memory_cal: Calibration | None = None

    @staticmethod
    def resolve(
        gpu: str | GpuSpec | Target = "h100", calibration: Calibration | None | bool = True
    ) -> Target:
        """The one place a GPU and its calibration are resolved.

        gpu: a built-in name or alias, a .toml/.json spec file, a CUDA device name as
        `torch.cuda.get_device_name()` reports it, a GpuSpec (or a Target, returned as it
        is). A name gobrrr cannot place raises GobrrrError saying so (never a default GPU).
        calibration: True = the saved calibration for this GPU if there is one (and, where there
        is none, its chip's for the memory's tables); False/None = none; or the Calibration to
        use."""
        if isinstance(gpu, Target):
            return gpu
        spec = gpu if isinstance(gpu, GpuSpec) else get_gpu(gpu)
        if calibration is not True:
            return Target(spec, calibration or None)
        cal = find_calibration(spec)
        return Target(spec, cal, memory_calibration(spec, cal))
