"""The `gobrrr` command: thin over the Python API. Parses, calls, prints.

Every error is one line on stderr and exit code 2; GOBRRR_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from gobrrr.errors import GobrrrError

EXAMPLES = {
    "estimate": """examples:
  gobrrr estimate --model gpt2 --gpu h100 --batch 16 --seq 1024
  gobrrr estimate --model llama3-8b --gpu h100 --batch 1 --seq 4096 --precision bf16-mixed
  gobrrr estimate my_train.py:workload --gpu a100-80gb --batch 32 --seq 512 --json""",
    "gpus": """examples:
  gobrrr gpus
  gobrrr gpus --json""",
}


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", nargs="?", help="path/to/file.py:function returning a "
                   "gobrrr.Workload (or use --model)")
    p.add_argument("--model", help="a built-in model (see `gobrrr estimate --help`)")
    p.add_argument("--batch", type=int, help="batch size passed to the workload")
    p.add_argument("--seq", type=int, help="sequence length passed to the workload")
    p.add_argument("--precision", default="bf16-mixed",
                   help="fp32 | tf32 | bf16-mixed | fp16-mixed | bf16 (default bf16-mixed)")
    p.add_argument("--checkpoint", default="none", help="none | full (checkpoint every block)")
    p.add_argument("--compile", action="store_true", help="the model runs under torch.compile")


def workload_spec(args: argparse.Namespace, default: str = "gpt2") -> str:
    if args.workload and args.model:
        raise GobrrrError("give either a workload file:function or --model, not both")
    return args.workload or args.model or default


def _estimate(args: argparse.Namespace) -> int:
    from gobrrr.estimate import estimate

    est = estimate(workload_spec(args), args.gpu, batch=args.batch, seq=args.seq,
                   precision=args.precision, checkpoint=args.checkpoint,
                   calibration=not args.no_calibration, compile=args.compile)
    if args.save_graph:
        est.graph.save(args.save_graph)
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        from gobrrr.report.terminal import print_estimate

        print_estimate(est)
    return 0


def _gpus(args: argparse.Namespace) -> int:
    from gobrrr.hardware import BUILTIN_GPUS

    if args.json:
        print(json.dumps([{"name": g.name, "aliases": list(g.aliases), "full_name": g.full_name,
                           "memory_bytes": g.memory_bytes, "bandwidth": g.bandwidth,
                           "peak_flops": g.peak_flops, "sms": g.sms} for g in BUILTIN_GPUS],
                         indent=2))
    else:
        from gobrrr.report.terminal import print_gpus

        print_gpus()
    return 0


def _bench(args: argparse.Namespace) -> int:
    from gobrrr.kernels.bench import run_benchmarks

    paths = run_benchmarks(args.out, which=tuple(args.which))
    for p in paths:
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from gobrrr.models.registry import model_names

    parser = argparse.ArgumentParser(
        prog="gobrrr", description="Where the time and memory of a PyTorch training step go.")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("estimate", help="predict memory and time on a GPU, without one",
                       epilog=EXAMPLES["estimate"] + "\n\nbuilt-in models: "
                       + ", ".join(model_names()), formatter_class=fmt)
    _add_workload_args(p)
    p.add_argument("--gpu", default="h100", help="target GPU name (see `gobrrr gpus`) or a "
                   ".toml/.json spec file (default h100)")
    p.add_argument("--no-calibration", action="store_true",
                   help="use datasheet peaks even if a calibration exists")
    p.add_argument("--save-graph", metavar="FILE", help="write the step graph as JSON")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=_estimate)

    p = sub.add_parser("gpus", help="list the built-in GPUs", epilog=EXAMPLES["gpus"],
                       formatter_class=fmt)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_gpus)

    p = sub.add_parser("bench", help="run the kernel benchmarks (needs a GPU)",
                       epilog="examples:\n  gobrrr bench kernels --out results/",
                       formatter_class=fmt)
    p.add_argument("target", choices=["kernels"])
    p.add_argument("--which", nargs="*", default=["all"],
                   help="attention, norms, lce, pointwise, gpt2 (default all)")
    p.add_argument("--out", default="benchmarks/results", help="where the JSON results go")
    p.set_defaults(func=_bench)

    _add_profile_commands(sub)
    return parser


def _add_profile_commands(sub) -> None:
    try:
        from gobrrr.profile.commands import add_calibrate_parser, add_profile_parser
    except ImportError:
        return
    add_profile_parser(sub)
    add_calibrate_parser(sub)


def main(argv: list[str] | None = None) -> int:
    debug = os.environ.get("GOBRRR_DEBUG") == "1"
    try:
        args = build_parser().parse_args(argv)
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except GobrrrError as e:
        if debug:
            raise
        print(f"gobrrr: error: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("gobrrr: error: interrupted; nothing was written", file=sys.stderr)
    except Exception as e:  # a bug in gobrrr or torch: still one line, unless debugging
        if debug:
            raise
        print(f"gobrrr: error: {type(e).__name__}: {e} (GOBRRR_DEBUG=1 shows the traceback)",
              file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
