"""Microbenchmarks that measure what one GPU achieves -> `gobrrr.hardware.Calibration`.

Measured (each the median of several runs, CUDA events, L2 flushed before each timed matmul):
- matmul FLOP/s per dtype (bf16, fp16, tf32, fp32 without TF32) on square n x n x n problems,
  and the curve of achieved fraction of the large-shape rate against FLOPs;
- bandwidth (bytes read + written per second) of a device copy, a pointwise op (cos) and a
  reduction (sum, bytes read) on 1 GiB;
- eager launch overhead: host seconds per tiny op (`y = y + 1` on 16 elements, in a loop);
  kernel latency: device seconds per tiny kernel (replayed from a CUDA graph);
- cuBLAS workspace: bytes the caching allocator gains on the first matmul after the
  workspaces are cleared (None when that cannot be observed).
The whole run takes well under a minute on an H100.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gobrrr.calibrate.sections import conv as cc
from gobrrr.calibrate.sections import cudagraph as ccg
from gobrrr.calibrate.sections import fp8 as cf8
from gobrrr.calibrate.sections import host as ch
from gobrrr.calibrate.sections import offload as co
from gobrrr.calibrate.sections import paths as cpa
from gobrrr.calibrate.sections import pixels as cpx
from gobrrr.calibrate.sections import pools as cpo
from gobrrr.calibrate.sections import power as cpw
from gobrrr.calibrate.sections import rnn as crnn
from gobrrr.calibrate.sections import shapes as csh
from gobrrr.calibrate.sections import step as cs
from gobrrr.calibrate.sections.kernels import kernel_host_costs
from gobrrr.calibrate.sections.optim import optim8_section
from gobrrr.calibrate.timing import flush_buffer, time_op
from gobrrr.errors import GobrrrError
from gobrrr.hardware import Calibration, Target, calibration_dirs
from gobrrr.profile.timing import sync

MATMUL_DTYPES = ("bf16", "fp16", "tf32", "fp32")
GPU_SIZES = (256, 512, 1024, 2048, 4096, 8192)
CPU_SIZES = (64, 128, 256)
_TORCH_DTYPE = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "tf32": torch.float32,
    "fp32": torch.float32,
}


def calibrate(
    device: str = "cuda",
    save: bool | str | Path = True,
    sizes: tuple[int, ...] | None = None,
    stream_bytes: int | None = None,
) -> Calibration:
    """Measure `device` and return (and by default save) its Calibration.

    save: True writes `~/.cache/gobrrr/calibration/<gpu>.json` (GOBRRR_HOME overrides the
        root), a path writes there, False writes nothing.
    sizes: matmul n values (default 256..8192 on a GPU, 64..256 on the CPU).
    stream_bytes: buffer size of the bandwidth tests (default 1 GiB on a GPU, 64 MiB on CPU).
    """
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise GobrrrError(
            f"calibrate on {device!r}: no CUDA GPU is visible; run it on the GPU "
            "to calibrate, or pass device='cpu'"
        )
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    key = _gpu_key(name) if cuda else _slug(name)
    t0 = time.perf_counter()
    workspace = blas_workspace(dev) if cuda else None
    sizes = sizes or (GPU_SIZES if cuda else CPU_SIZES)
    rates, curves = {}, {}
    for dt in MATMUL_DTYPES:
        rates[dt], curves[dt] = matmul_rate(dev, dt, sizes)
    nbytes = stream_bytes or (2**30 if cuda else 64 * 2**20)
    copy_bw, pw_bw, red_bw = bandwidths(dev, nbytes)
    host, latency = launch_overhead(dev)
    extra = _step_measurements(dev, cuda)
    cal = Calibration(
        gpu=key,
        device_name=name,
        matmul_flops=rates,
        copy_bandwidth=copy_bw,
        pointwise_bandwidth=pw_bw,
        reduction_bandwidth=red_bw,
        launch_overhead=host,
        kernel_latency=latency,
        blas_workspace=workspace,
        matmul_curve=curves,
        meta=_meta(dev, sizes, nbytes, time.perf_counter() - t0),
        **extra,
    )
    if save:
        path = Path(save) if not isinstance(save, bool) else default_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        cal.save(path)
    return cal


def _gpu_key(device_name: str) -> str:
    """The name the calibration is saved under: the built-in spec's CUDA's device name
    resolves to (`Target.resolve`), else a slug of the device name."""
    try:
        return Target.resolve(device_name, calibration=False).gpu.name
    except GobrrrError:
        return _slug(device_name)


def _step_measurements(dev: torch.device, cuda: bool) -> dict:
    """Per-op host cost inside a training step, and on a GPU every section of `gpu_sections`
    (see calibrate_step, calibrate_host)."""
    overhead = ch.step_overhead(dev) if cuda else ch.step_overhead(dev, 5, rounds=1, warmup=3)
    out: dict = {"op_overhead": overhead}
    if cuda:
        for measure in gpu_sections().values():
            out.update(measure(dev))
    return out


def gpu_sections() -> dict[str, Callable[[torch.device], dict]]:
    """The calibration sections measured on a GPU, in the order `calibrate` measures them:
    name -> fn(device) -> {Calibration field: value}."""
    return {
        "conv_grid": lambda d: dict(
            zip(("conv_grid", "conv_workspace"), cc.conv_grid(d), strict=True)
        ),
        "batch_norm_bandwidth": lambda d: {"batch_norm_bandwidth": cs.batch_norm_bandwidths(d)},
        "batch_norm_grid": lambda d: {"batch_norm_grid": cs.batch_norm_grid(d)},
        "layer_norm_grid": lambda d: {"layer_norm_grid": cs.layer_norm_grid(d)},
        "depthwise_bandwidth": lambda d: {"depthwise_bandwidth": cc.depthwise_bandwidths(d)},
        "outer_sum_bandwidth": lambda d: {"outer_sum_bandwidth": cs.outer_sum_bandwidths(d)},
        "matmul_misaligned": lambda d: {
            "matmul_misaligned": {**cs.misaligned_fractions(d), **csh.misaligned_by_alignment(d)}
        },
        "size_bandwidth": lambda d: {"size_bandwidth": csh.size_bandwidths(d)},
        "path_bandwidth": lambda d: {"path_bandwidth": cpa.path_bandwidths(d)},
        "softmax_grid": lambda d: {"softmax_grid": cpa.softmax_grid(d)},
        "embedding_backward": lambda d: {"embedding_backward": cs.embedding_backward_fit(d)},
        "attention_curve": lambda d: {
            "attention_curve": {**cs.attention_rate(d), **cs.attention_variants(d)}
        },
        "op_bandwidth": lambda d: {"op_bandwidth": cs.op_bandwidths(d)},
        # the fp8 grid (torch._scaled_mm) beside bf16's, on GPUs with FP8 tensor cores
        "matmul_grid": lambda d: {"matmul_grid": {**cs.matmul_grid(d), **cf8.fp8_matmul_grid(d)}},
        "op_host": lambda d: {"op_host": ch.op_host_costs(d)},
        "optimizer_host": lambda d: {"optimizer_host": ch.optimizer_host(d)},
        "kernel_host": lambda d: {"kernel_host": kernel_host_costs(d)},
        "blaslt_workspace": lambda d: {"blaslt_workspace": cs.blaslt_workspace(d)},
        "optim8": optim8_section,
        "power_duty": lambda d: {"power_duty": cpw.power_duty(d)},
        "offload": co.offload_section,
        "rnn_grid": lambda d: {"rnn_grid": crnn.rnn_grid(d)},
        "pixel_grid": lambda d: {"pixel_grid": cpx.pixel_grid(d)},
        "pool_grid": lambda d: {"pool_grid": cpo.pool_grid(d)},
        "cudagraph_grid": lambda d: {"cudagraph": ccg.cudagraph_section(d)},
    }


def default_path(key: str) -> Path:
    """Where a user's calibration of GPU `key` lives."""
    return calibration_dirs()[0] / f"{key}.json"


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def matmul_rate(dev: torch.device, dtype: str, sizes) -> tuple[float, list[list[float]]]:
    """(large-shape FLOP/s, [[flops, fraction of it], ...]) for n x n x n matmuls in `dtype`.
    The large-shape rate is the best over the shapes measured."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    flush = flush_buffer(dev)
    points = []
    try:
        for n in sizes:
            g = torch.Generator(device=dev).manual_seed(n)
            a = torch.randn(n, n, device=dev, dtype=_TORCH_DTYPE[dtype], generator=g)
            b = torch.randn(n, n, device=dev, dtype=_TORCH_DTYPE[dtype], generator=g)
            c = torch.empty(n, n, device=dev, dtype=_TORCH_DTYPE[dtype])
            reps = 10 if n >= 4096 else 25
            t = time_op(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), dev, reps, flush)
            points.append((2.0 * n**3, 2.0 * n**3 / t))
            del a, b, c
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    best = max(r for _, r in points)
    return best, [[f, r / best] for f, r in points]


def bandwidths(dev: torch.device, nbytes: int) -> tuple[float, float, float]:
    """(copy, pointwise, reduction) bytes/s on fp32 buffers of `nbytes`: copy and cos count
    bytes read + written, sum counts bytes read."""
    n = nbytes // 4
    x = torch.rand(n, device=dev)
    y = torch.empty_like(x)
    copy = 2 * nbytes / time_op(lambda: y.copy_(x), dev, 10)
    pointwise = 2 * nbytes / time_op(lambda: torch.cos(x, out=y), dev, 10)
    s = torch.empty((), device=dev)
    reduction = nbytes / time_op(lambda: torch.sum(x, dim=0, out=s), dev, 10)
    return copy, pointwise, reduction


def launch_overhead(dev: torch.device, n: int = 2000) -> tuple[float, float]:
    """(host seconds per tiny eager op, device seconds per tiny kernel)."""
    y = torch.zeros(16, device=dev)
    for _ in range(50):
        y = y + 1
    sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        y = y + 1
    sync(dev)
    host = (time.perf_counter() - t) / n
    if dev.type != "cuda":
        return host, host
    return host, _graph_kernel_latency(dev)


def _graph_kernel_latency(dev: torch.device, n: int = 200) -> float:
    """Device seconds per tiny kernel, from replaying n of them captured in a CUDA graph (no
    host launch in between)."""
    y = torch.zeros(16, device=dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(3):
            y.add_(1)
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            y.add_(1)
    return time_op(g.replay, dev, 10) / n


def blas_workspace(dev: torch.device) -> int | None:
    """Bytes the first matmul adds to `memory_allocated` beyond its output, after clearing
    cuBLAS's workspaces (None when torch cannot clear them or nothing was seen)."""
    try:
        torch._C._cuda_clearCublasWorkspaces()
    except (AttributeError, RuntimeError):
        return None
    a = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    sync(dev)
    before = torch.cuda.memory_allocated(dev)
    c = a @ a
    sync(dev)
    gained = torch.cuda.memory_allocated(dev) - before - c.untyped_storage().nbytes()
    return int(gained) if gained > 0 else None


def _meta(dev: torch.device, sizes, nbytes: int, seconds: float) -> dict:
    import datetime

    meta = {
        "torch": torch.__version__,
        "sizes": list(sizes),
        "stream_bytes": nbytes,
        "seconds": round(seconds, 2),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        meta.update(
            cuda=torch.version.cuda, memory=props.total_memory, sms=props.multi_processor_count
        )
        try:
            import triton

            meta.update(triton=triton.__version__)
        except ImportError:
            pass
    return meta
