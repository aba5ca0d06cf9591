"""`gobrrr profile` and `gobrrr calibrate`: argparse glue over the Python API, rich output.

Handlers return an exit code; bad input raises GobrrrError (the CLI prints one line, exit 2).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict

from gobrrr.capture import capture
from gobrrr.capture.sdpa import target_for
from gobrrr.errors import GobrrrError
from gobrrr.estimate import workload_factory
from gobrrr.evaluate import evaluate
from gobrrr.hardware import Target, match_device_name
from gobrrr.workload import Workload, iter_tensors

PROFILE_DESCRIPTION = """Measure a real training step: time, per-op regimes, MFU / HFU, idle
time, diagnosis. MFU counts the FLOPs of the traced forward and backward (no
recompute), HFU every FLOP the step runs, both over the precision's dense matmul
peak, as `gobrrr estimate` does (the step is traced on the CPU under fake
tensors first to count them). Throughput: tokens/s for sequence workloads,
samples/s otherwise."""

PROFILE_EXAMPLES = """examples:
  gobrrr profile gpt2 --batch 8 --seq 1024 --precision bf16-mixed
  gobrrr profile gpt2 --batch 1 --seq 256 --scaling
  gobrrr profile gpt2 --batch 8 --seq 1024 --compare --trace step.json
  gobrrr profile my_train.py:workload --compile --json
  gobrrr profile gpt2 --device cpu --batch 1 --seq 64 --steps 2"""

CALIBRATE_EXAMPLES = """examples:
  gobrrr calibrate
  gobrrr calibrate --output h100.json --json"""


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    """The `profile` subcommand: measure a real training step."""
    p = subparsers.add_parser(
        "profile",
        help="measure a real training step on the GPU",
        description=PROFILE_DESCRIPTION,
        epilog=PROFILE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("workload", nargs="?", help="a built-in model name, or path/file.py:function")
    p.add_argument("--model", help="a built-in model (same as the positional argument)")
    p.add_argument("--gpu", help="GPU spec to judge against (default: the one CUDA reports)")
    p.add_argument("--batch", type=int, help="batch size")
    p.add_argument("--seq", type=int, help="sequence length")
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        help="fp32 | tf32 | bf16-mixed | fp16-mixed | bf16 (default bf16-mixed)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (default 3)")
    p.add_argument("--checkpoint", default="none", help="none | full (checkpoint every block)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model first")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also capture the step graph and compare with the prediction",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="time the step at batch B, 2B, 4B: is it overhead-bound?",
    )
    p.add_argument("--trace", metavar="FILE", help="write the profiled step as a Chrome trace")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--html", metavar="FILE", help="also write one HTML page with the charts")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.set_defaults(func=run_profile)
    return p


def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    """The `calibrate` subcommand: microbenchmarks of this GPU."""
    p = subparsers.add_parser(
        "calibrate",
        help="measure this GPU's achieved rates",
        epilog=CALIBRATE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument(
        "--output",
        metavar="FILE",
        help="where to save (default ~/.cache/gobrrr/calibration/<gpu>.json)",
    )
    p.add_argument("--no-save", action="store_true", help="measure and print only")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_calibrate)
    return p


def _factory(args) -> Callable[[int | None], Workload]:
    if args.workload and args.model:
        raise GobrrrError("give either a workload name / file:function or --model, not both")
    spec = args.workload or args.model
    if not spec:
        raise GobrrrError("name a workload: gobrrr profile gpt2 (or path/file.py:function)")
    return lambda b: workload_factory(spec, b, args.seq)()


def run_profile(args) -> int:
    """Handler of `gobrrr profile`."""
    from gobrrr.profile.api import profile  # lazy: loaded for this command only
    from gobrrr.report.html import require_plotly, write_html  # lazy: this command only

    if args.html:
        require_plotly()  # before the work, not after it
    make = _factory(args)
    out: dict = {}
    graph = prediction = None
    gpu: str | Target | None = args.gpu
    if args.compare:
        graph, gpu, prediction = _predict(make, args)
    result = profile(
        make(args.batch),
        device=args.device,
        precision=args.precision,
        steps=args.steps,
        warmup=args.warmup,
        checkpoint=args.checkpoint,
        compile=args.compile,
        trace_path=args.trace,
        graph=graph,
        gpu=gpu,
    )
    out["profile"] = asdict(result)
    comparison = scaling = None
    if prediction is not None:
        from gobrrr.profile.compare import compare  # lazy: loaded for this command only

        comparison = compare(prediction, result)
        out["compare"] = comparison.to_dict()
    if args.scaling:
        from gobrrr.profile.scaling import scaling as run_scaling  # lazy: this command only

        batch = args.batch or _default_batch(make)
        scaling = run_scaling(
            make, batch, args.device, args.precision, args.steps, args.warmup, compile=args.compile
        )
        out["scaling"] = scaling.to_dict()
    if args.html:
        write_html(out, args.html)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        from gobrrr.profile.show import print_profile  # lazy: loaded for this command only

        print_profile(result, comparison, scaling)
    return 0


def _default_batch(make) -> int:
    """The batch size a workload builds when none is given (built on the meta device)."""
    import torch

    with torch.device("meta"):
        ts = list(iter_tensors(make(None).batch))
    return int(ts[0].shape[0]) if ts and ts[0].dim() else 1


def _predict(make, args):
    """The step graph and its prediction on the GPU profiled: traced as that GPU runs it (its
    attention backends, torch.compile when the profiled step is compiled) and evaluated on
    its spec and calibration (`Target.resolve`)."""
    target = _compare_target(args)
    graph = capture(
        lambda: make(args.batch),
        precision=args.precision,
        checkpoint=args.checkpoint,
        sdpa=target_for(target.gpu.full_name),
        compile=args.compile,
    )
    return graph, target, evaluate(graph, target).time


def _compare_target(args) -> Target:
    """--gpu when given, else the GPU CUDA reports; a GobrrrError when neither names one."""
    if args.gpu:
        return Target.resolve(args.gpu)
    import torch

    if not (args.device.startswith("cuda") and torch.cuda.is_available()):
        raise GobrrrError(
            f"--compare on {args.device!r}: no CUDA GPU names the GPU to predict for",
            hint="pass --gpu NAME (a built-in name or a spec file)",
        )
    name = torch.cuda.get_device_name(args.device)
    try:
        return Target.resolve(name)
    except GobrrrError as e:
        if match_device_name(name) is not None:
            raise  # the GPU is known: its calibration failed to load
        raise GobrrrError(
            f"--compare: CUDA reports {name!r}, which no built-in GPU spec names",
            hint="pass --gpu NAME or a .toml/.json spec file of this "
            "GPU (`gobrrr gpus` lists the built-ins)",
        ) from e


def run_calibrate(args) -> int:
    """Handler of `gobrrr calibrate`."""
    from gobrrr.calibrate.api import calibrate, default_path  # lazy: loaded for this command only

    save = False if args.no_save else (args.output or True)
    cal = calibrate(args.device, save=save)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=1))
    else:
        from gobrrr.profile.show import print_calibration  # lazy: loaded for this command only

        where = args.output or (None if args.no_save else str(default_path(cal.gpu)))
        print_calibration(cal, where)
    return 0
