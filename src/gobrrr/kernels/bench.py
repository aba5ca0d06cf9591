"""Benchmark harness for the kernels, and the entry of `gobrrr bench kernels`.

The benchmark scripts live in the repository's benchmarks/ folder (they need a GPU and write
JSON); this module holds what they share (environment record, timing, peak memory, JSON, a
text table) and `run_benchmarks`, which loads the scripts by path and runs their `run`.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from gobrrr.errors import GobrrrError

SCRIPTS = {
    "lce": "kernels/bench_linear_cross_entropy.py",
    "norms": "kernels/bench_norms.py",
    "pointwise": "kernels/bench_pointwise.py",
    "gpt2_kernels": "kernels/bench_gpt2_kernels.py",
    "convergence": "kernels/convergence_gpt.py",
}
GiB = 1024**3


def cuda_kernels(fn: Callable[[], object], reps: int = 1) -> list[tuple[str, float]]:
    """(name, seconds) of every CUDA kernel `reps` calls of fn() run, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return [
        (e.name, e.time_range.elapsed_us() / 1e6)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]


def env_info() -> dict:
    """Device, memory, driver, CUDA, torch, triton versions and the UTC date of this run."""
    import triton

    info = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / GiB, 2),
            sms=props.multi_processor_count,
            driver=_driver(),
        )
    return info


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def gpu_tag() -> str:
    """Short name of the GPU for result file names: 'h100', 'h200', ... or 'cpu'."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    for tag in ("h200", "h100", "a100", "l40s", "l4", "b200", "mi300"):
        if tag in name:
            return tag
    return name.split()[-1]


def time_ms(
    fn: Callable[[], object],
    warmup: int = 50,
    rep: int = 300,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> dict:
    """Median and 20th/80th percentile time of fn() in ms (triton do_bench: CUDA events, the L2
    cache flushed before every call outside the timed region; includes host launch overhead
    that the GPU cannot hide). warmup/rep in ms. On failure returns {'error': ...}."""
    from triton.testing import do_bench

    try:
        med, lo, hi = do_bench(
            fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8]
        )
    except Exception as e:  # noqa: BLE001 - a failing variant must not end the benchmark
        return {"error": repr(e)[:300]}
    return {"median_ms": med, "p20_ms": lo, "p80_ms": hi}


def time_graph_ms(fn: Callable[[], object], rep: int = 100) -> dict:
    """Median and 20th/80th percentile GPU time of fn() in ms, from replays of a CUDA graph of
    repeated calls (triton do_bench_cudagraph): the kernels' own time, without the host's launch
    overhead. No L2 flush: use it for inputs larger than L2. rep in ms. On failure (fn not
    capturable) returns {'error': ...}."""
    from triton.testing import do_bench_cudagraph

    try:
        med, lo, hi = do_bench_cudagraph(fn, rep=rep, quantiles=[0.5, 0.2, 0.8])
    except Exception as e:  # noqa: BLE001 - callers fall back to time_ms
        torch.cuda.synchronize()
        return {"error": repr(e)[:300]}
    return {"median_ms": med, "p20_ms": lo, "p80_ms": hi}


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated by fn() above what was allocated before it (results kept alive)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def generator(seed: int = 0, device: str = "cuda") -> torch.Generator:
    """A private RNG for benchmark inputs: unaffected by a CUDA-graph capture that failed (a
    failed capture can leave the default CUDA generator unusable)."""
    return torch.Generator(device=device).manual_seed(seed)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in fp32 (Frobenius)."""
    a, e = actual.float(), expected.float()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def gpu_out_arg(doc: str, name: str, argv: Sequence[str] | None = None) -> str | None:
    """The OUT.json path of a GPU benchmark's command line (its only argument; `doc`, the
    script's docstring, describes it); None, after one line on stderr, without a CUDA GPU."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU", file=sys.stderr)
        return None
    return args.out


def write_json(path: str | Path, payload: dict) -> Path:
    """Write payload (plus version and environment) as indented JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"version": 1, "env": env_info(), **payload}
    path.write_text(json.dumps(body, indent=2, default=float) + "\n")
    return path


def table(rows: Iterable[dict], cols: Sequence[str]) -> str:
    """Plain fixed-width text table of `rows` over `cols` (floats to 3 significant figures)."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def out_only_main(run: Callable[[str], object], doc: str, argv=None) -> None:
    """The command line of a benchmark script whose one argument is its output JSON path."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("out", help="output JSON path")
    run(p.parse_args(argv).out)


def _benchmarks_dir() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "benchmarks" / SCRIPTS["norms"]).is_file():
            return parent / "benchmarks"
    raise GobrrrError(
        "benchmarks/ not found next to this gobrrr checkout; run `gobrrr bench kernels` from a "
        "source checkout (git clone ...; pip install -e .)"
    )


def _load(name: str):
    path = _benchmarks_dir() / SCRIPTS[name]
    spec = importlib.util.spec_from_file_location(f"gobrrr_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_benchmarks(out_dir: str | Path, which: Sequence[str] = ("all",)) -> list[Path]:
    """Run the kernel benchmarks named in `which` ('all', or keys of SCRIPTS) on this GPU.

    Each writes out_dir/<name>_<gpu>.json. Returns the paths written. Needs a CUDA GPU.
    """
    if not torch.cuda.is_available():
        raise GobrrrError("kernel benchmarks need a CUDA GPU; run them on a machine with one")
    names = list(SCRIPTS) if "all" in which else list(which)
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        raise GobrrrError(f"unknown benchmark(s) {unknown}; choose from {['all', *SCRIPTS]}")
    out_dir = Path(out_dir)
    return [_load(n).run(out_dir / f"{n}_{gpu_tag()}.json") for n in names]
