"""`gobrrr profile` and `gobrrr calibrate`: argparse glue over the Python API, rich output.

Handlers return an exit code; bad input raises GobrrrError (the CLI prints one line, exit 2).
Under torchrun (`profile --parallel`, `calibrate --collectives`) every rank runs the handler
and rank 0 alone prints; a failure is one line from the rank that failed first, exit code 2 on
every rank, and no rank waits for one that is gone (`gobrrr.profile.ranks`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict

from gobrrr.capture import capture
from gobrrr.capture.sdpa import target_for
from gobrrr.cli import interrupt
from gobrrr.errors import GobrrrError
from gobrrr.estimate import PARALLEL, workload_factory
from gobrrr.evaluate import evaluate
from gobrrr.hardware import Target, match_device_name
from gobrrr.profile.ranks import DEFAULT_TIMEOUT_S
from gobrrr.training.step import batch_size
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
  gobrrr profile gpt2 --device cpu --batch 1 --seq 64 --steps 2
  torchrun --nproc-per-node 4 -m gobrrr profile my_train.py:workload --parallel fsdp --compare
  torchrun --nproc-per-node 2 -m gobrrr profile gpt2 --batch 2 --seq 1024 --parallel ddp --json"""

CALIBRATE_EXAMPLES = """examples:
  gobrrr calibrate
  gobrrr calibrate --output h100.json --json
  torchrun --nproc-per-node 4 -m gobrrr calibrate --collectives
  torchrun --nproc-per-node 2 -m gobrrr calibrate --collectives --quick --no-save"""


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
    p.add_argument(
        "--parallel",
        choices=PARALLEL,
        help="under torchrun: every rank runs the step data-parallel, DDP or FSDP2 "
        "(--batch is per rank)",
    )
    p.add_argument(
        "--reshard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FSDP2's reshard_after_forward (default on)",
    )
    _timeout_arg(p)
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
    p.add_argument(
        "--collectives",
        action="store_true",
        help="under torchrun: NCCL's all-reduce, all-gather and reduce-scatter over message "
        "sizes, merged into this GPU's calibration",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="with --collectives: a coarse grid (1 MiB to 1 GiB by 4x, fewer rounds, no "
        "overlap test), for a quick check",
    )
    _timeout_arg(p)
    p.set_defaults(func=run_calibrate)
    return p


def _timeout_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help="under torchrun: seconds a rank waits for the others in one step or "
        f"measurement before it gives up (default {DEFAULT_TIMEOUT_S:g})",
    )


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
    from gobrrr.profile.runner import check_device
    from gobrrr.report.html import require_plotly, write_html  # lazy: this command only

    if args.html:
        require_plotly()  # before the work, not after it
    if args.parallel:
        return _on_ranks(args, "profile --parallel", _profile_parallel)
    make = _factory(args)
    check_device(args.device)  # before the model is built in host memory
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
    interrupt.commit()  # a Ctrl-C swallowed during the work: no output at all; then all of it
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

    if args.no_save and args.output:
        raise GobrrrError(
            f"--output {args.output} with --no-save: one says where to save, the other not to",
            hint="drop --no-save to save there, or --output to only measure and print",
        )
    if args.collectives:
        return _on_ranks(args, "calibrate --collectives", _calibrate_collectives)
    if args.quick:
        raise GobrrrError("--quick sets the grid of --collectives", hint="add --collectives")
    save = False if args.no_save else (args.output or True)
    cal = calibrate(args.device, save=save)
    interrupt.commit()
    if args.json:
        print(json.dumps(cal.to_dict(), indent=1))
    else:
        from gobrrr.profile.show import print_calibration  # lazy: loaded for this command only

        where = args.output or (None if args.no_save else str(default_path(cal.gpu)))
        print_calibration(cal, where)
    return 0


# -- under torchrun: every rank runs, rank 0 speaks --------------------------------------------


def _on_ranks(args, command: str, body: Callable[..., int]) -> int:
    """`body(args, group, watchdog)` on every rank of the torchrun job. Any failure is one
    line from the rank that failed first (the others stop quietly, or say they timed out
    waiting) and exit code 2 on every rank, without waiting at exit for ranks that are gone."""
    from gobrrr.profile import ranks  # lazy: loaded for these commands only

    group = ranks.join(args.timeout, command, getattr(args, "device", "cuda"))
    as_json = args.json and group.is_first

    def report(e: BaseException) -> None:
        _fail_rank(e, group.rank, group.world, as_json)

    dog = ranks.Watchdog(group.rank, args.timeout, report)
    try:
        code = body(args, group, dog)
    except BaseException as e:  # every failure ends this rank here, reported once
        if not isinstance(e, ranks.OtherRankFailed):
            report(_rank_error(e, group.rank, args.timeout, dog.last))
        ranks.leave(2)
    if code:
        ranks.leave(code)
    with dog.waiting("leaving the job"):
        _destroy()
    # the job's work is done and said: exit without the interpreter's teardown, as a failing
    # rank does. A rank torn down by Python's finalization was seen to abort once in a while
    # in CPU (gloo) jobs ("terminate called without an active exception": a C++ thread
    # object destroyed at exit), which fails the whole torchrun job after its work was done
    ranks.leave(code)


def _rank_error(e: BaseException, rank: int, timeout_s: float, where: str) -> BaseException:
    """The error a rank reports, torch.distributed's timeouts and lost peers worded with
    `where` (the phase the rank was in)."""
    from gobrrr.profile import ranks

    if ranks.is_timeout(e):
        return ranks.timed_out(rank, timeout_s, where)
    if ranks.lost_peer(e):
        return GobrrrError(
            f"rank {rank} stopped in {where}: another rank left the job",
            hint="the rank that failed says why above",
        )
    if isinstance(e, KeyboardInterrupt):
        return GobrrrError("interrupted", hint="nothing was written")
    return e


def _fail_rank(e: BaseException, rank: int, world: int, as_json: bool) -> None:
    """The command line's one error path (`app._fail`), the rank named when there are
    several."""
    from gobrrr.cli.app import _fail
    from gobrrr.cli.checks import explain

    message, hint = explain(e)
    if world > 1 and not message.startswith(f"rank {rank} "):
        message = f"rank {rank}: {message}"
    _fail(GobrrrError(message, hint=hint), as_json)


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _workload_raised(spec: str, fn: Callable[[], object]):
    """`fn()`, an exception from the user's workload worded as `profile` words it."""
    try:
        return fn()
    except (GobrrrError, KeyboardInterrupt):
        raise
    except Exception as e:  # the user's model, loss or optimizer failed
        if _distributed_error(e):
            raise  # a peer's failure or timeout, worded by _rank_error
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise GobrrrError(
            f"workload {spec!r} raised {type(e).__name__}: {msg}",
            hint="run it once without gobrrr to debug; GOBRRR_DEBUG=1 shows the traceback",
        ) from e


def _distributed_error(e: BaseException) -> bool:
    import torch.distributed as dist

    from gobrrr.profile import ranks

    return isinstance(e, dist.DistError) or ranks.is_timeout(e) or ranks.lost_peer(e)


def _profile_parallel(args, group, dog) -> int:
    """Every rank: the step measured data-parallel; rank 0 prints the job's figures."""
    from gobrrr.profile import distributed as pd
    from gobrrr.profile.ranks import agreed
    from gobrrr.profile.runner import check_device

    given_flags = (
        ("--compile", args.compile),
        ("--scaling", args.scaling),
        ("--trace", args.trace),
        ("--html", args.html),
    )
    for flag, given in given_flags:
        if given:
            raise GobrrrError(f"{flag} is not measured with --parallel", hint=f"drop {flag}")
    run = pd.ParallelRun(
        args.parallel, args.precision, args.steps, args.warmup, args.checkpoint,
        args.reshard, args.batch, args.seq,
    )  # fmt: skip
    make = _factory(args)
    spec = args.workload or args.model

    def setup():  # no collective inside: a failure on any rank is agreed on, then reported
        check_device(args.device)
        pd.check_run(run)
        target = _compare_target(args) if args.compare else None
        wl = _workload_raised(spec, lambda: pd.prepare_rank(make(args.batch), group, run))
        return wl, target

    (wl, scaler), target = agreed(setup)
    run = dataclasses.replace(run, batch=batch_size(wl.batch))  # the one built, when not given
    with dog.waiting("wrapping the model"):
        step = _workload_raised(spec, lambda: pd.wrap_step(wl, scaler, group, run))
    rank = _workload_raised(spec, lambda: pd.measure_rank(step, group, run, dog))
    ranks = pd.gather(rank, group, dog)
    if ranks is None:
        return 0
    out = pd.summarize(ranks, run, spec)
    if target is not None:
        out["predicted"] = pd.predict(lambda: make(args.batch), target, run, group.world)
        out["error"] = pd.errors(out["measured"], out["predicted"])
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        from gobrrr.profile.show import print_parallel  # lazy: loaded for this command only

        print_parallel(out)
    return 0


def _calibrate_collectives(args, group, dog) -> int:
    """Every rank: NCCL's collectives measured, then (without --quick) the contention grid;
    rank 0 merges them into the GPU's calibration (unless --no-save) and prints."""
    import torch

    from gobrrr.calibrate import merge
    from gobrrr.calibrate.sections import collectives as cs
    from gobrrr.calibrate.sections import contention as ct
    from gobrrr.profile.ranks import agreed

    def setup():  # no collective inside: a failure on any rank is agreed on, then reported
        if group.device.type != "cuda":
            raise GobrrrError(
                "calibrate --collectives measures NCCL between CUDA GPUs, and this rank "
                f"sees none (device {args.device!r})",
                hint="run it on a machine with two or more GPUs",
            )
        if group.world < 2:
            raise GobrrrError(
                "calibrate --collectives on 1 rank: a collective needs two or more",
                hint="start it with torchrun --nproc-per-node 2 (or more)",
            )
        if not group.is_first or args.no_save:
            return None
        name = torch.cuda.get_device_name()
        path = merge.target_path(name, args.output)
        return path, merge.base_calibration(name, path)

    where = agreed(setup)
    result = cs.measure_all(
        cs.QUICK_SIZES if args.quick else cs.SIZES,
        rounds=5 if args.quick else 15,
        overlap=not args.quick,
        max_iters=20 if args.quick else 100,
        waiting=dog.waiting,
        sweeps=1 if args.quick else 5,
    )
    grid = None
    if not args.quick:  # what the collectives and the compute beside them cost each other
        with dog.waiting("the contention grid"):
            grid = ct.measure_all()
    if not group.is_first:
        return 0
    if where is not None:
        path, base = where
        merged = merge.merge_collectives(base, result, "gobrrr calibrate --collectives")
        if grid is not None:
            merged = merge.merge_contention(merged, grid, "gobrrr calibrate --collectives")
        merge.write_calibration(merged, path)
    saved = str(where[0]) if where is not None else None
    if args.json:
        print(json.dumps({"saved": saved, **result}, indent=1))
        return 0
    print("\n".join(cs.summary_lines(result)))
    print(f"saved to {saved}" if saved else "not saved (--no-save)")
    return 0
