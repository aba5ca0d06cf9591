"""The `gobrrr` command: thin over the Python API. Parses, checks, calls, prints.

Every error is one line on stderr and exit code 2; under `--json` it is also a JSON object
on stdout, {"version", "error", "hint"}. GOBRRR_DEBUG=1 prints the traceback first (and still
exits 2). Arguments the run would ignore are warned about, output paths are checked before
the work starts, and only gobrrr's own output reaches stdout (see `gobrrr.report.streams`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from gobrrr.capture import CHECKPOINTS
from gobrrr.cli import interrupt
from gobrrr.cli.checks import OUTPUT_FILES, check_args, check_output_file, explain
from gobrrr.cli.measure import add_calibrate_parser, add_profile_parser
from gobrrr.errors import MAX_COUNT, GobrrrError, did_you_mean
from gobrrr.estimate import LOOPS, PARALLEL, estimate, workload_factory
from gobrrr.hardware import BUILTIN_GPUS, get_gpu
from gobrrr.kernels.bench import SCRIPTS, run_benchmarks
from gobrrr.models.registry import model_names
from gobrrr.plan.search import MARGIN, Planner
from gobrrr.plan.trace import processes_to_spare
from gobrrr.plan.verify import verify
from gobrrr.precision import PRECISIONS
from gobrrr.report.charts import estimate_charts, json_text, plan_charts
from gobrrr.report.estimate import estimate_dict
from gobrrr.report.html import read_result, require_plotly, write_html
from gobrrr.report.progress import Progress
from gobrrr.report.streams import command_streams, one_line

JSON_VERSION = 1
MAX_BYTES = 2**60  # a memory budget beyond 1 EiB is a typo
#: exit code when the reader of stdout went away (`gobrrr ... | head`): 128 + SIGPIPE, what a
#: shell reports for a program SIGPIPE ended, as cat or git do; the output was cut, not wrong
BROKEN_PIPE = 141

EXAMPLES = {
    "estimate": """examples:
  gobrrr estimate --model gpt2 --gpu h100 --batch 16 --seq 1024
  gobrrr estimate --model llama3-8b --gpu h100 --batch 1 --seq 4096 --precision bf16-mixed
  gobrrr estimate my_train.py:workload --gpu a100-80gb --batch 32 --seq 512 --json
  gobrrr estimate --model convnet --gpu mygpu.toml --top 30
  gobrrr estimate --model llama3-1b --batch 2 --seq 2048 --compile blocks --checkpoint full
  gobrrr estimate --model gpt2 --batch 16 --seq 1024 --gpus 8 --parallel ddp
  gobrrr estimate --model llama3-1b --batch 1 --seq 8192 --gpus 4 --parallel fsdp
  gobrrr estimate --model llama3-8b --batch 1 --seq 8192 --gpus 8 --parallel fsdp --no-reshard
  gobrrr estimate --model llama3-70b --seq 8192 --gpus 64 --nodes 8 --parallel hsdp""",
    "plan": """examples:
  gobrrr plan --model gpt2 --global-batch 64 --seq 1024
  gobrrr plan my_train.py:workload --gpu h100 --global-batch 64 --seq 4096
  gobrrr plan --model llama3-1b --gpu a100-80gb --global-batch 32 --seq 8192 \\
              --memory-budget 70GiB --json
  gobrrr plan --model llama3-1b --gpu h100 --gpus 4 --global-batch 16 --seq 8192""",
    "report": """examples:
  gobrrr estimate --model gpt2 --batch 16 --json > gpt2.json
  gobrrr report gpt2.json -o gpt2.html""",
    "gpus": """examples:
  gobrrr gpus
  gobrrr gpus --json""",
    "bench": """examples:
  gobrrr bench kernels --out results/
  gobrrr bench kernels --which norms lce --json""",
}
PRECISION_HELP = "fp32 | tf32 | bf16-mixed | fp16-mixed | bf16 (default bf16-mixed)"
HTML_HELP = "also write one HTML page with the charts (needs gobrrr[report])"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are GobrrrErrors (one line, exit 2, JSON under --json) that say
    where the help is, with "did you mean" for a misspelt command or option."""

    def error(self, message: str):
        command = self.prog.removeprefix("gobrrr").strip()
        raise GobrrrError(
            f"{command + ': ' if command else ''}{message}{_suggest(self, message)}",
            hint=f"see `{self.prog} --help`",
        )


def _suggest(parser: argparse.ArgumentParser, message: str) -> str:
    if "invalid choice: '" in message:
        word = message.split("invalid choice: '", 1)[1].split("'", 1)[0]
        choices = [c for a in parser._actions if a.choices for c in a.choices]
        return did_you_mean(word, choices)
    if message.startswith("unrecognized arguments: "):
        word = message.split(": ", 1)[1].split()[0].split("=")[0]
        return did_you_mean(word, _option_strings(parser))
    return ""


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    out = [s for a in parser._actions for s in a.option_strings]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out += _option_strings(sub)
    return out


def positive_int(text: str) -> int:
    """argparse type: a whole number > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive whole number (e.g. 8), got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number (e.g. 8), got {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{value} is too large: at most {MAX_COUNT:,}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1), e.g. 0.05 (not inf, nan or a percentage)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 1:  # nan fails the comparison too
        raise argparse.ArgumentTypeError(
            f"expected a share of the budget in [0, 1), e.g. 0.05 for 5%, got {text!r}"
        )
    return value


def gpu_count(text: str) -> int:
    """argparse type of --gpus: a whole number > 0. A GPU's name there is the --gpu option
    mistyped, and the error says so."""
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        if _names_a_gpu(text):
            raise argparse.ArgumentTypeError(
                f"--gpus takes how many GPUs; {text!r} is a GPU: did you mean '--gpu'?"
            ) from None
        raise


def _names(text: str) -> list[str]:
    """argparse type: comma-separated names, at least one."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"expected module names such as layers.0,layers.1, got {text!r}"
        )
    return names


def _names_a_gpu(text: str) -> bool:
    try:
        get_gpu(text)
    except GobrrrError:
        return False
    return True


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def byte_size(text: str) -> int:
    """argparse type: a size in bytes, e.g. 70GiB, 75GB, 8e10."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num) :]
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"expected a size such as 70GiB, 75GB or 80000000000, got {text!r}"
        ) from None
    if not math.isfinite(value) or value > MAX_BYTES:  # inf, nan, 1e400
        raise argparse.ArgumentTypeError(
            f"expected a finite size such as 70GiB (at most 1EiB), got {text!r}"
        )
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value)


def one_of(kind: str, options: tuple[str, ...]) -> Callable[[str], str]:
    """argparse type: one of `options`, with "did you mean" for a close misspelling."""

    def check(text: str) -> str:
        if text in options:
            return text
        raise argparse.ArgumentTypeError(
            f"unknown {kind} {text!r}{did_you_mean(text, options)}"
            f": choose one of {', '.join(options)}"
        )

    return check


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "workload",
        nargs="?",
        help="path/to/file.py:function returning a gobrrr.Workload (or use --model)",
    )
    p.add_argument("--model", help="a built-in model (listed below)")
    p.add_argument("--batch", type=positive_int, help="batch size passed to the workload")
    p.add_argument("--seq", type=positive_int, help="sequence length passed to the workload")
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        type=one_of("precision", PRECISIONS),
        help=PRECISION_HELP,
    )
    p.add_argument(
        "--checkpoint",
        default="none",
        type=one_of("checkpoint mode", CHECKPOINTS),
        help="none | full (checkpoint every block)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="model",
        default="none",
        metavar="blocks",
        help="the model runs under torch.compile: --compile, the whole model; "
        "--compile blocks, each repeated block on its own, the rest eager (regional "
        "compilation: one compile for every block; combines with --checkpoint full)",
    )


def compile_arg(args: argparse.Namespace) -> str:
    """--compile's mode: "none", "model" (--compile alone) or "blocks". A workload written
    right after a bare --compile (`estimate --compile my.py:fn`) is the workload."""
    value = args.compile
    if value in ("none", "model", "blocks"):
        return value
    if args.workload is None and args.model is None and value != "none":
        args.workload = value
        return "model"
    raise GobrrrError(
        f"--compile {value!r}: give --compile alone (the whole model) or --compile blocks "
        "(each repeated block)"
    )


def workload_spec(args: argparse.Namespace, default: str = "gpt2") -> str:
    if args.workload and args.model:
        raise GobrrrError("give either a workload file:function or --model, not both")
    return args.workload or args.model or default


def _estimate(args: argparse.Namespace) -> int:
    if args.html:
        require_plotly()  # before the work, not after it
    est = estimate(
        workload_spec(args),
        args.gpu,
        batch=args.batch,
        seq=args.seq,
        precision=args.precision,
        checkpoint=args.checkpoint,
        calibration=not args.no_calibration,
        compile=args.compile,
        gpus=args.gpus,
        nodes=args.nodes,
        parallel=args.parallel,
        reshard_after_forward=args.reshard,
        units=args.units,
        loop=args.loop,
    )
    if args.save_graph:
        est.graph.save(args.save_graph)
    if not _emit(args, estimate_dict(est, top=args.top), lambda: estimate_charts(est)):
        from gobrrr.report.terminal import print_estimate  # lazy: rich, for tables only

        print_estimate(est, top=args.top)
        _wrote(args.html)
    return 0


def _emit(args: argparse.Namespace, data: dict, charts: Callable[[], dict]) -> bool:
    """The result's machine-readable outputs: `charts()` added where --json or --html wants
    them, the warnings, the page (--html), the JSON on stdout (--json). True when the JSON
    was printed (no tables then)."""
    interrupt.check()  # a Ctrl-C swallowed during the work: no output at all
    if args.json or args.html:
        data["charts"] = charts()
    data["warnings"] = args.warnings
    interrupt.commit()  # from here the output is written whole
    if args.html:
        write_html(data, args.html)
    if args.json:
        print(json_text(data))
    return bool(args.json)


def _wrote(path: str | None) -> None:
    if path:
        print(f"report: {path}")


def _plan(args: argparse.Namespace) -> int:
    if args.html:
        require_plotly()  # before the work, not after it
    progress = None if args.json else Progress("costing (variant, micro-batch) pairs:")
    if progress:
        progress.note(f"tracing {workload_spec(args)} (a few seconds to minutes)")
    planner = Planner(
        workload_spec(args),
        args.gpu,
        global_batch=args.global_batch,
        seq=args.seq,
        precision=args.precision,
        memory_budget=args.memory_budget,
        allow=args.allow,
        margin=args.margin,
        calibration=not args.no_calibration,
        gpus=args.gpus,
        nodes=args.nodes,
        ahead=processes_to_spare(),  # this process is gobrrr's: trace in children too
    )
    result = planner.run(progress)
    verified = _verify(args, result) if args.verify else None
    extra = {"verified": [v.to_dict() for v in verified]} if verified is not None else {}
    data = {**result.to_dict(top=args.top), **extra}
    edge = headroom(result, planner.req.margin)
    if edge is not None:
        data["headroom"] = edge
    if not _emit(args, data, lambda: plan_charts(planner, result)):
        from gobrrr.report.plan import print_plan, print_verified  # lazy: rich, for tables only

        print_plan(result, top=args.top)
        if edge is not None:
            print(edge["says"])
        if verified is not None:
            print_verified(verified)
        _wrote(args.html)
    return 0 if result.best is not None else 1


#: below this share of the budget free, the plan is called "at the edge": the reserved peak
#: was predicted within -3.3%..+5.3% on an H100 (plan/search.py MARGIN's note)
EDGE = 0.05


def headroom(result, margin: float) -> dict | None:
    """How close the chosen plan's reserved peak comes to the budget, and the margin kept
    (`--margin`; the planner's default MARGIN keeps none): for the output and --json."""
    best = result.best
    if best is None:
        return None
    budget, free = result.budget_bytes, best.headroom_bytes
    share = free / budget
    gib = 2**30
    says = (
        f"headroom: the chosen plan leaves {free / gib:.1f} GiB of the {budget / gib:.1f} GiB "
        f"budget free ({share:.1%}); "
        + (
            f"--margin {margin:g} kept {margin:.0%} of it free"
            if margin
            else "no margin kept (the default --margin 0 lets a plan fill the budget)"
        )
    )
    if share < EDGE:
        says += (
            f". That is at the edge: the reserved peak is predicted within about 5%, "
            f"so for room to spare plan with --margin {EDGE:g} ({EDGE:.0%} kept free)"
        )
    return {
        "bytes": free,
        "share": share,
        "margin": margin,
        "default_margin": MARGIN,
        "at_edge": share < EDGE,
        "says": says,
    }


def _report(args: argparse.Namespace) -> int:
    require_plotly()
    out = args.output or str(Path(args.result).with_suffix(".html"))
    if Path(out).resolve() == Path(args.result).resolve():
        raise GobrrrError(f"-o {out} is the result itself", hint="give another file, -o page.html")
    check_output_file(out, "-o")
    path = write_html(read_result(args.result), out)
    print(json.dumps({"version": JSON_VERSION, "written": str(path)}) if args.json else path)
    return 0


def _verify(args: argparse.Namespace, result) -> list:
    fitting = [p for p in result.plans if p.fits][: args.verify]
    make = lambda g: workload_factory(workload_spec(args), g, args.seq)()  # noqa: E731
    return verify(make, fitting, args.precision)


def _gpus(args: argparse.Namespace) -> int:
    if args.json:
        print(
            json.dumps(
                {
                    "version": JSON_VERSION,
                    "gpus": [
                        {
                            "name": g.name,
                            "aliases": list(g.aliases),
                            "full_name": g.full_name,
                            "memory_bytes": g.memory_bytes,
                            "bandwidth": g.bandwidth,
                            "peak_flops": g.peak_flops,
                            "sms": g.sms,
                        }
                        for g in BUILTIN_GPUS
                    ],
                },
                indent=2,
            )
        )
    else:
        from gobrrr.report.terminal import print_gpus  # lazy: rich, for tables only

        print_gpus()
    return 0


def _bench(args: argparse.Namespace) -> int:
    paths = run_benchmarks(args.out, which=tuple(args.which))
    if args.json:
        print(json.dumps({"version": JSON_VERSION, "written": [str(p) for p in paths]}, indent=2))
    else:
        for p in paths:
            print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gobrrr", description="Where the time and memory of a PyTorch training step go."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser(
        "estimate",
        help="predict memory and time on a GPU, without one",
        epilog=EXAMPLES["estimate"] + "\n\nbuilt-in models: " + ", ".join(model_names()),
        formatter_class=fmt,
    )
    _add_workload_args(p)
    p.add_argument(
        "--gpu",
        default="h100",
        help="target GPU name (see `gobrrr gpus`) or a .toml/.json spec file (default h100)",
    )
    p.add_argument(
        "--no-calibration",
        action="store_true",
        help="use datasheet peaks even if a calibration exists",
    )
    p.add_argument(
        "--top",
        type=positive_int,
        default=12,
        metavar="N",
        help="rows of the op and module tables (default 12)",
    )
    p.add_argument(
        "--gpus",
        type=gpu_count,
        default=1,
        metavar="N",
        help="data-parallel GPUs in all; --batch is each GPU's (default 1)",
    )
    p.add_argument(
        "--nodes", type=positive_int, default=1, metavar="M", help="hosts they span (default 1)"
    )
    p.add_argument(
        "--parallel",
        default="ddp",
        type=one_of("data-parallel recipe", PARALLEL),
        help="ddp | fsdp (FSDP2's fully_shard over every GPU) | hsdp (FSDP2 sharded within "
        "each node, replicated across --nodes > 1), with --gpus > 1 (default ddp)",
    )
    p.add_argument(
        "--reshard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fsdp/hsdp: free each unit's gathered parameters after its forward "
        "(reshard_after_forward; default on)",
    )
    p.add_argument(
        "--units",
        type=_names,
        metavar="NAME,NAME",
        help="fsdp/hsdp: the modules wrapped as FSDP2 units, as model.named_modules() names "
        "them (default: the repeated blocks)",
    )
    p.add_argument(
        "--loop",
        type=one_of("loop", LOOPS),
        help="the training loop whose memory is predicted: keeps-output (default: "
        "out = model(...); loss.backward(); opt.step(), the output alive until the next step) "
        "| drops-output (Lightning, gobrrr's plan/apply, HF Trainer in fp32: freed before "
        "backward) | hf-trainer (HF Trainer: dropped too, after Accelerate's mixed precision "
        "copied its fp16/bf16 tensors to fp32) "
        "| zero-grad-first (timm's and torchvision's train_one_epoch: the output kept, and "
        "zero_grad() just before backward, so last step's gradients live through the forward)",
    )
    p.add_argument("--save-graph", metavar="FILE", help="write the step graph as JSON")
    p.add_argument("--html", metavar="FILE", help=HTML_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=_estimate)

    _add_plan_parser(sub, fmt, model_names())

    p = sub.add_parser(
        "gpus", help="list the built-in GPUs", epilog=EXAMPLES["gpus"], formatter_class=fmt
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_gpus)

    p = sub.add_parser(
        "bench",
        help="run the kernel benchmarks (needs a GPU)",
        epilog=EXAMPLES["bench"],
        formatter_class=fmt,
    )
    p.add_argument("target", choices=["kernels"])
    p.add_argument(
        "--which",
        nargs="*",
        default=["all"],
        choices=["all", *SCRIPTS],
        metavar="NAME",
        help=f"which benchmarks: {', '.join(SCRIPTS)} (default all)",
    )
    p.add_argument(
        "--out",
        default="benchmarks/results",
        help="an existing directory for the JSON results (default benchmarks/results)",
    )
    p.add_argument("--json", action="store_true", help="print the written paths as JSON")
    p.set_defaults(func=_bench)

    _add_profile_commands(sub)
    _add_report_parser(sub, fmt)
    return parser


def _add_report_parser(sub, fmt) -> None:
    p = sub.add_parser(
        "report",
        help="one HTML page (charts) from a saved --json output",
        epilog=EXAMPLES["report"],
        formatter_class=fmt,
    )
    p.add_argument("result", help="a saved `--json` output of estimate, profile or plan")
    p.add_argument("-o", "--output", metavar="FILE", help="the page (default: RESULT.html)")
    p.add_argument("--json", action="store_true", help="print the written path as JSON")
    p.set_defaults(func=_report)


def _add_plan_parser(sub, fmt, models: list[str]) -> None:
    p = sub.add_parser(
        "plan",
        help="find the fastest configuration that fits the GPU",
        epilog=EXAMPLES["plan"] + "\n\nbuilt-in models: " + ", ".join(models),
        formatter_class=fmt,
    )
    p.add_argument(
        "workload",
        nargs="?",
        help="path/to/file.py:function returning a gobrrr.Workload (or use --model)",
    )
    p.add_argument("--model", help="a built-in model (listed below)")
    p.add_argument(
        "--global-batch",
        type=positive_int,
        metavar="N",
        help="samples (sequences or images) per optimizer step (default: the workload's batch)",
    )
    p.add_argument("--seq", type=positive_int, help="sequence length passed to the workload")
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        type=one_of("precision", PRECISIONS),
        help=PRECISION_HELP + "; the plan keeps it",
    )
    p.add_argument(
        "--gpu",
        default="h100",
        help="target GPU name (see `gobrrr gpus`) or a .toml/.json spec file (default h100)",
    )
    p.add_argument(
        "--memory-budget",
        type=byte_size,
        metavar="SIZE",
        help="most memory the step may reserve, e.g. 70GiB (default: what CUDA "
        "leaves the process on the GPU)",
    )
    p.add_argument(
        "--margin",
        type=fraction,
        default=0.0,
        metavar="F",
        help="share of the budget to leave free, e.g. 0.05 (default 0: the "
        "predicted reserved peak may take the whole budget)",
    )
    p.add_argument(
        "--allow",
        type=lambda s: [a for a in s.split(",") if a],
        default=[],
        metavar="A,B",
        help="knobs that change the numerics, allowed to the plan: "
        "bf16-states (the optimizer's moments in bf16), 8bit-states (torchao's "
        "8-bit AdamW moments; gobrrr[optim] to apply), bf16-weights (pure bf16: "
        "weights, gradients and states in bf16, no autocast), compile (the model "
        "under torch.compile, whole and per repeated block), offload (the "
        "optimizer's states and AdamW update on the CPU, torchao's "
        "CPUOffloadOptimizer; costed from the calibration's "
        "offload section), fp8 (the linear layers in FP8, torchao's float8 "
        "recipe; GPUs with FP8 tensor cores only), cudagraphs (the whole step "
        "captured as one CUDA graph and replayed: the same numerics, for host-bound "
        "steps; costed from the calibration's cudagraph section)",
    )
    p.add_argument(
        "--no-calibration",
        action="store_true",
        help="use datasheet peaks even if a calibration exists",
    )
    p.add_argument(
        "--top", type=positive_int, default=8, metavar="N", help="plans shown (default 8)"
    )
    p.add_argument(
        "--verify",
        type=positive_int,
        nargs="?",
        const=3,
        metavar="K",
        help="on a GPU: apply the best K plans (default 3) and measure each beside its prediction",
    )
    p.add_argument("--html", metavar="FILE", help=HTML_HELP)
    p.add_argument(
        "--gpus",
        type=gpu_count,
        default=1,
        metavar="N",
        help="data-parallel GPUs in all (default 1); with N > 1 the plan chooses DDP or "
        "FSDP2 too, --global-batch is the whole job's and each rank takes 1/N of it",
    )
    p.add_argument(
        "--nodes", type=positive_int, default=1, metavar="M", help="hosts they span (default 1)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=_plan)


def _add_profile_commands(sub) -> None:
    add_profile_parser(sub)
    add_calibrate_parser(sub)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    with interrupt.handling():
        try:
            with _stdout_fd_to_stderr(), command_streams() as said:
                try:
                    args = build_parser().parse_args(argv)  # --help exits here, as argparse does
                except GobrrrError as e:
                    return _fail(e, as_json)
                args.warnings = said
                return _run(args, as_json)
        except BrokenPipeError:  # the reader of stdout went away (`| head`): nothing to say
            _stdout_to_devnull()
            return BROKEN_PIPE


def _run(args: argparse.Namespace, as_json: bool) -> int:
    before = _outputs(args)
    try:
        if args.command == "estimate":  # before the checks: it may name the workload
            args.compile = compile_arg(args)
        check_args(args)
        func: Callable[[argparse.Namespace], int] = args.func
        code = func(args)
        interrupt.check()  # a Ctrl-C that library code swallowed still ends the run
        return code
    except SystemExit as e:  # the user's code exited; argparse never gets here
        if _raised_by(e, "rich."):  # rich's way out when the reader of a pipe went away
            return BROKEN_PIPE
        return _fail(
            GobrrrError(
                f"the workload called sys.exit({e.code!r}) while gobrrr imported or ran it",
                hint="gobrrr builds and runs the step itself: remove the exit, or put the "
                'script\'s own code under `if __name__ == "__main__":`',
            ),
            as_json,
        )
    except KeyboardInterrupt:
        removed = _remove_changed(before)
        hint = f"removed the half-written {', '.join(removed)}" if removed else None
        return _fail(GobrrrError("interrupted", hint=hint), as_json, interrupt.INTERRUPTED)
    except Exception as e:
        return _fail(e, as_json)


def _outputs(args: argparse.Namespace) -> dict[Path, tuple[int, int] | None]:
    """The output files the command may write, each with (mtime_ns, size) or None when it
    does not exist yet."""
    out: dict[Path, tuple[int, int] | None] = {}
    for attr in OUTPUT_FILES:
        path = getattr(args, attr, None)
        if isinstance(path, str) and path.strip():
            p = Path(path).expanduser()
            st = p.stat() if p.is_file() else None
            out[p] = (st.st_mtime_ns, st.st_size) if st else None
    return out


def _remove_changed(before: dict[Path, tuple[int, int] | None]) -> list[str]:
    """Remove the output files written since `before` (an interrupted write is partial)."""
    removed = []
    for p, was in before.items():
        st = p.stat() if p.is_file() else None
        if st is not None and (st.st_mtime_ns, st.st_size) != was:
            p.unlink()
            removed.append(str(p))
    return removed


@contextlib.contextmanager
def _stdout_fd_to_stderr():
    """While the command runs, file descriptor 1 is stderr's and sys.stdout writes to a copy
    of the real fd 1: whatever the user's code or a C library writes to fd 1 (os.write(1),
    a subprocess) lands on stderr, so stdout holds only gobrrr's output (the JSON under
    --json). Where sys.stdout is not fd 1 (a test capturing it) nothing changes."""
    try:
        if sys.stdout.fileno() != 1:
            raise ValueError("not fd 1")
        sys.stdout.flush()
        saved = os.dup(1)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        yield
        return
    real = sys.stdout
    out = io.TextIOWrapper(
        io.FileIO(saved, "w", closefd=False),
        encoding=getattr(real, "encoding", None) or "utf-8",
        errors=getattr(real, "errors", None) or "strict",
        line_buffering=bool(getattr(real, "line_buffering", False)),
    )
    os.dup2(2, 1)
    sys.stdout = out
    try:
        yield
    finally:
        sys.stdout = real
        try:
            out.flush()
        except BrokenPipeError:
            _to_devnull(saved)
            raise
        finally:
            out.close()  # flushes to devnull where the pipe broke; leaves `saved` open
            os.dup2(saved, 1)
            os.close(saved)


def _to_devnull(fd: int) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def _stdout_to_devnull() -> None:
    """After the reader of stdout went away: what is still buffered goes nowhere, quietly,
    rather than a second BrokenPipeError when Python flushes stdout at exit."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        _to_devnull(sys.stdout.fileno())


def _raised_by(e: BaseException, module: str) -> bool:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith(module)


def _fail(e: BaseException, as_json: bool, code: int = 2) -> int:
    """One line on stderr (after the traceback under GOBRRR_DEBUG=1), the same as JSON on
    stdout under --json; exit code 2 (130 when interrupted)."""
    if os.environ.get("GOBRRR_DEBUG") == "1":
        traceback.print_exc()
    message, hint = explain(e)
    message = one_line(message).rstrip(".")
    line = f"{message}: {one_line(hint)}" if hint else message
    print(f"gobrrr: error: {line}", file=sys.stderr)
    if as_json:
        print(
            json.dumps(
                {
                    "version": JSON_VERSION,
                    "error": message,
                    "hint": one_line(hint) if hint else None,
                },
                indent=2,
            )
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
