"""What the command line checks before the work starts, and how it words what went wrong.

`check_args`: an empty or misspelt workload, output paths that cannot be written (checked
before a run that may take minutes, not after it), and arguments the run would not use
(`--seq` for a model without a sequence, `--batch` for a function without `batch_size`),
which are warned about. `explain`: an exception as (message, hint), the hint saying what to
change for the errors users meet most (a step that reads tensor values, a failing model).
"""

from __future__ import annotations

import argparse
import ast
import os
import warnings
from pathlib import Path

from gobrrr.errors import GobrrrError, GobrrrWarning, did_you_mean
from gobrrr.estimate import not_a_directory
from gobrrr.hardware import get_gpu
from gobrrr.models.registry import describe, model_names
from gobrrr.training.qlora import INSTALL, missing

# argparse attribute -> the option that set it, for output files
OUTPUT_FILES = {
    "save_graph": "--save-graph",
    "trace": "--trace",
    "output": "--output",
    "html": "--html",
}


def check_args(args: argparse.Namespace) -> None:
    """Everything the command line can check before the work starts; raises GobrrrError,
    warns (GobrrrWarning) about arguments the run will not use."""
    for attr, flag in OUTPUT_FILES.items():
        if getattr(args, attr, None) is not None:
            check_output_file(args.__dict__[attr], flag)
    if args.command == "bench":
        check_output_dir(args.out, "--out")
    if args.command == "profile":
        if args.gpu is not None:  # named before the run, not after it
            get_gpu(args.gpu)
        for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0)):
            if value < least:
                raise GobrrrError(
                    f"{flag} {value} is too few",
                    hint="give a positive whole number" if least else "give 0 or more",
                )
    if args.command in ("estimate", "profile", "plan"):
        spec = _spec(args)
        if spec is not None:
            check_unused(spec, getattr(args, "batch", None), getattr(args, "seq", None))


def _spec(args: argparse.Namespace) -> str | None:
    for name, flag in (("workload", "the workload argument"), ("model", "--model")):
        value = getattr(args, name, None)
        if value is not None and not value.strip():
            raise GobrrrError(
                f"{flag} is empty",
                hint="name a built-in model ("
                f"{', '.join(model_names())}) or give path/to/file.py:function",
            )
    spec = getattr(args, "workload", None) or getattr(args, "model", None)
    if spec and (_is_file_spec(spec) or Path(spec).expanduser().is_dir()):
        not_a_directory(spec)
    if spec and not _is_file_spec(spec) and spec not in model_names():
        raise GobrrrError(
            f"unknown model {spec!r}{did_you_mean(spec, model_names())}",
            hint=f"choose one of {', '.join(model_names())}, or give path/to/file.py:function",
        )
    return spec or (None if args.command == "profile" else "gpt2")


def _is_file_spec(spec: str) -> bool:
    return ":" in spec or spec.endswith(".py")


def check_output_file(path: str, flag: str) -> None:
    """The file `path` can be created: its folder exists and is writable, and it is not a
    folder itself. Nothing is created here."""
    p = Path(path).expanduser()
    if not str(path).strip():
        raise GobrrrError(f"{flag} is empty", hint=f"give a file path, e.g. {flag} out.json")
    if p.is_dir():
        raise GobrrrError(
            f"{flag} {path} is a directory", hint=f"give a file path, e.g. {p / 'out.json'}"
        )
    folder = p.parent
    if not folder.exists():
        raise GobrrrError(
            f"{flag} {path}: directory {folder} does not exist",
            hint=f"create it first (mkdir -p {folder}) or choose another path",
        )
    if not folder.is_dir():
        raise GobrrrError(
            f"{flag} {path}: {folder} is a file, not a directory",
            hint="choose a path inside a directory",
        )
    if not os.access(folder, os.W_OK):
        raise GobrrrError(
            f"{flag} {path}: directory {folder} is not writable",
            hint="choose a directory you can write to",
        )


def check_output_dir(path: str, flag: str) -> None:
    p = Path(path).expanduser()
    if not p.is_dir():
        what = "is a file" if p.exists() else "does not exist"
        raise GobrrrError(
            f"{flag} {path} {what}", hint=f"give an existing directory (mkdir -p {path})"
        )
    if not os.access(p, os.W_OK):
        raise GobrrrError(
            f"{flag} {path} is not writable", hint="choose a directory you can write to"
        )


def check_unused(spec: str, batch: int | None, seq: int | None) -> None:
    """Warn about --batch / --seq that the workload will not receive."""
    if _is_file_spec(spec):
        takes = _function_args(spec)
        if takes is None:
            return
        for flag, value, arg in (("--batch", batch, "batch_size"), ("--seq", seq, "seq_len")):
            if value is not None and arg not in takes and "**" not in takes:
                warnings.warn(
                    f"{flag} {value} is not used: {spec} takes no {arg} argument "
                    f"(add `{arg}: int` to its parameters to receive it)",
                    GobrrrWarning,
                    stacklevel=2,
                )
        return
    if seq is not None and "max_seq_len" not in describe(spec):
        warnings.warn(
            f"--seq {seq} is not used: {spec} is not a sequence model (drop --seq)",
            GobrrrWarning,
            stacklevel=2,
        )


def _function_args(spec: str) -> set[str] | None:
    """Parameter names of `function` in `file.py:function`, read from the source without
    running it ("**" stands for **kwargs); None when it cannot be read."""
    path, _, name = spec.rpartition(":")
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
            return names | ({"**"} if a.kwarg else set())
    return None


# (text in the message, what to change): the errors users meet most, worded as fixes
KNOWN = (
    (
        "numpy() is not supported",
        "gobrrr traces the step on fake tensors, which hold no "
        "values: .numpy() (and .tolist(), .item()) cannot run inside it; compute it with torch ops",
    ),
    (
        "Can't call numpy()",
        "gobrrr traces the step on fake tensors, which hold no values: "
        "compute it with torch ops instead of .numpy()",
    ),
    (
        "_local_scalar_dense",
        "the code reads a tensor's value (.item(), float(t), `if t > 0:`, "
        ".tolist()), which fake tensors do not have: keep it in torch (e.g. torch.where) or "
        "compute it from Python numbers",
    ),
    (
        "found at least two devices, cpu and cuda",
        "gobrrr traces on the CPU, as the GPU would run it, and the workload moved part of "
        "it to CUDA (.cuda() or .to('cuda')): remove those calls from the workload function "
        "(gobrrr profile moves the model and batch to the GPU itself)",
    ),
    (
        "hasPrimaryContext",
        "gobrrr traces without a GPU, and the workload asked CUDA for a device "
        "(.cuda(), .to('cuda'), torch.cuda.*): remove those calls from the workload function "
        "(gobrrr profile moves the model and batch to the GPU itself)",
    ),
    (
        "run_and_save",
        "--compile with --checkpoint full is not modelled: torch.compile cannot trace "
        "gobrrr's checkpointed blocks on fake tensors; predict with one of the two",
    ),
    (
        "the traced step raised",
        "the error is in the step's own code on the batch given: run "
        "one step of it in plain PyTorch to find it (GOBRRR_DEBUG=1 shows the traceback)",
    ),
    (
        "optimizer's first step raised",
        "the optimizer failed on the model's parameters: try it "
        "in plain PyTorch (GOBRRR_DEBUG=1 shows the traceback)",
    ),
    (
        " raised ",
        "the workload function failed before anything was traced: call it once in "
        "plain Python to debug (GOBRRR_DEBUG=1 shows the traceback)",
    ),
)


def explain(e: BaseException) -> tuple[str, str | None]:
    """(message, hint) for an exception: a GobrrrError's own, the inner one where gobrrr
    wrapped a GobrrrError raised in the user's workload function, a hint for the known
    errors, and for anything else its type and text."""
    if not isinstance(e, GobrrrError):
        return f"{type(e).__name__}: {e}", "GOBRRR_DEBUG=1 shows the traceback"
    cause = e.__cause__
    if isinstance(cause, ModuleNotFoundError) and cause.name in INSTALL:  # peft, bitsandbytes
        where = e.message.split(" raised ", 1)[0].split(": importing ", 1)[0]
        return missing(cause.name, where).message, INSTALL[cause.name]
    if isinstance(cause, GobrrrError) and " raised GobrrrError" in e.message:
        where = e.message.split(" raised GobrrrError", 1)[0]
        return f"{where}: {cause.message}", cause.hint
    if e.hint:
        return e.message, e.hint
    message = e.message
    if "_local_scalar_dense" in message:  # not an output shape: a value read on the host
        message = message.split(": its output shape depends", 1)[0]
    for needle, hint in KNOWN:
        if needle in message:
            return message, hint
    return message, None
