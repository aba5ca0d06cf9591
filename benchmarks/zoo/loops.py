"""The loops users run, measured: peak memory and step time of one zoo model under several
training loops, and gobrrr's prediction for each loop (`gobrrr.estimate(loop=...)`).

    PYTHONUNBUFFERED=1 python benchmarks/zoo/loops.py OUT.json [--cases NAME,NAME]
    python benchmarks/zoo/loops.py /tmp/loops.json --device cpu --tiny --cases gpt2-124m

The zoo-wide run that tests read is tests/fixtures/loops_zoo_h200.json (`--cases zoo`,
measured with `--measure-only`, predicted with `--predict-only`, joined with `--merge`):
write a new run there.

Each (case, loop) runs in a fresh process of this script (`--one CASE LOOP`): the case built
on the device (seeded) and prepared as gobrrr's profile runner prepares it (moved, cast,
its optimizer made), 3 warm-up steps of the loop, the peak-memory stats reset, `--steps`
steps timed (wall clock between device syncs, median); then `max_memory_allocated` and
`max_memory_reserved` over them. The loops, each written to match its original's
statements (forward and loss under the precision's autocast, backward outside it):

- trainstep: gobrrr's own step (`gobrrr.training.step.TrainStep`, what profile and apply run):
  the model's output dropped once the loss is taken. Predicted with loop="drops-output".
- plain: `out = model(...); loss = out.loss (or loss_fn(out, y)); loss.backward();
  opt.step(); opt.zero_grad()`: `out` alive until the next step rebinds it.
  loop="keeps-output".
- hf-trainer (transformers models): a real `transformers.Trainer` built around the model
  with `TrainingArguments(bf16=...)`, stepped as its own loop steps it (`hf_trainer_loop`):
  the model and optimizer prepared by its Accelerator (which autocasts the forward and
  returns its outputs in fp32), the attributes its loop sets, `trainer.training_step(model,
  inputs, num_items_in_batch)`, `optimizer.step()`, `model.zero_grad()`; compute_loss
  returns only the loss. loop="hf-trainer" (in fp32, the same as "drops-output": the
  Accelerator's fp32 copy of the fp16/bf16 outputs is what it adds). Needs accelerate
  (recorded as an error without it).
- timm (image models): timm's train.py `train_one_epoch` as of commit 004fb5f: `output =
  model(input); loss = loss_fn(output, target)` under autocast, `optimizer.zero_grad()`,
  `loss.backward()`, `optimizer.step()`: `output` kept, and last step's gradients alive
  through the forward (zero_grad comes before backward). loop="zero-grad-first".
- torchvision (image models): references/classification/train.py `train_one_epoch`: the
  same statements as timm's, then `utils.accuracy(output, target, topk=(1, 5))` on the kept
  output. loop="zero-grad-first".

The plain, timm and torchvision loops rebind their output as the forward returns, as the
originals' `out = model(...)` does (rebound after the step instead, the previous output and
the current one would both be alive through backward: measured so on an H100 before, two
outputs above TrainStep).

Predictions run on the CPU (fake tensors) in the parent process, with the calibration of the
device's GPU where one is shipped. An exception is recorded, never fatal; OUT.json is
rewritten after every run. torch 2.11, transformers 5.17 and (where it imports) timm, no
network: the models are the zoo's (random weights).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2]), str(HERE.parents[1])]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gobrrr.training.step import autocast_for  # noqa: E402
from gobrrr.workload import extract_loss  # noqa: E402

VERSION = 1
#: (zoo case, batch, seq): the shapes the loops are compared at (None: the case's own)
CASES = [
    ("llama3.2-1b", 4, 2048),
    ("qwen2-0.5b", 8, 1024),
    ("bert-base-mlm-fp32", 32, 512),
    ("gpt2-124m", 8, 1024),
    ("resnet50-tv-fp32", None, None),
    ("vit_b_16-tv", None, None),
    ("vit_small-timm", None, None),
]
TINY = {"batch": 2, "seq": 32}  # --tiny: every case at this shape (a CPU dry run)
HF_LOOPS = ("trainstep", "plain", "hf-trainer")
IMAGE_LOOPS = ("trainstep", "plain", "timm", "torchvision")
#: the loop gobrrr predicts each measured loop with
PREDICTED_AS = {
    "trainstep": "drops-output",
    "hf-trainer": "hf-trainer",
    "plain": "keeps-output",
    "timm": "zero-grad-first",
    "torchvision": "zero-grad-first",
}
NOT_MODELLED: dict[str, str] = {}


def loops_for(case) -> tuple[str, ...]:
    return HF_LOOPS if case.library == "transformers" else IMAGE_LOOPS


# -- the loops ---------------------------------------------------------------------------------


def _output(wl, batch):
    """What the model returned, as a hand-written loop calls it (`model(input)` for the zoo's
    image cases, whose `step` is cross_entropy(model(x), y); `model(**batch)` otherwise)."""
    return wl.model(batch[0]) if wl.step is not None else wl.run_model(batch)


def _loss(wl, out, batch):
    """The loss a hand-written loop takes from `out`: `loss_fn(output, target)` for images,
    `out.loss` (or the workload's loss) for the rest."""
    if wl.step is not None:
        return F.cross_entropy(out[0] if isinstance(out, tuple) else out, batch[1])
    return wl.loss(out, batch) if wl.loss is not None else extract_loss(out)


def plain_loop(wl, opt, precision, device):
    """`out = model(...); loss = out.loss; loss.backward(); opt.step(); opt.zero_grad()`.

    `step.out` is the loop's `out`: rebound as soon as the forward returns, which is when
    the loop lets the previous step's output go (held to the end of the step, as a rebinding
    after the step would, the previous output and the current one are both alive through
    backward: two outputs, not the loop's one)."""

    def step():
        with autocast_for(precision, device):
            step.out = _output(wl, wl.batch)
            loss = _loss(wl, step.out, wl.batch)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step.out = None
    return step


def timm_loop(wl, opt, precision, device, accuracy: bool = False):
    """timm's train_one_epoch body (and, with `accuracy`, torchvision's reference):
    `output = model(input)` rebound as the forward returns, as in plain_loop."""

    def step():
        with autocast_for(precision, device):
            step.output = _output(wl, wl.batch)
            loss = _loss(wl, step.output, wl.batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if accuracy:  # utils.accuracy(output, target, topk=(1, 5))
            logits = step.output[0] if isinstance(step.output, tuple) else step.output
            _, pred = logits.topk(5, 1, True, True)
            step.acc = pred.t().eq(wl.batch[1].view(1, -1)).float().sum()

    step.output = None
    return step


def hf_trainer_loop(wl, opt, precision, device):
    """One optimizer step of a real `transformers.Trainer`, as its `_inner_training_loop` and
    `_run_epoch` (transformers 5.17) run it with one batch per step: the model and the
    optimizer prepared together by its Accelerator, `current_gradient_accumulation_steps` set
    to the batches of the step (1) and `num_items_in_batch` counted from the labels before
    `training_step(model, inputs, num_items_in_batch)`, then `optimizer.step()` and
    `model.zero_grad()`. The optimizer is gobrrr's (the one the other loops step)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        bf16=precision == "bf16-mixed",
        per_device_train_batch_size=next(iter(wl.batch.values())).shape[0],
        report_to=[],
        use_cpu=device == "cpu",
    )
    trainer = Trainer(model=wl.model, args=args)
    model, optimizer = trainer.accelerator.prepare(wl.model, opt)  # as _inner_training_loop
    trainer.model_wrapped, trainer.optimizer = model, optimizer
    trainer.current_gradient_accumulation_steps = 1  # _run_epoch: len(batch_samples)
    trainer.accelerator.gradient_state._set_sync_gradients(True)  # the step's last batch

    def step():
        inputs = dict(wl.batch)
        n_items = trainer._get_num_items_in_batch([inputs], args.device)  # get_batch_samples
        trainer.training_step(model, inputs, n_items)
        optimizer.step()
        model.zero_grad()

    step.trainer = trainer
    return step


def make_loop(name, wl, opt, scaler, precision, device):
    if name == "trainstep":
        from gobrrr.training.step import TrainStep

        return TrainStep(wl, opt, precision, device_type=device, scaler=scaler, keep_loss=False)
    if name == "plain":
        return plain_loop(wl, opt, precision, device)
    if name == "hf-trainer":
        return hf_trainer_loop(wl, opt, precision, device)
    return timm_loop(wl, opt, precision, device, accuracy=name == "torchvision")


# -- the child: one case under one loop ------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(case_name: str, loop: str, device: str, batch, seq, warmup: int, steps: int) -> dict:
    from gobrrr.profile.runner import prepare
    from zoo.cases import get_case

    case = get_case(case_name)
    torch.manual_seed(0)
    with torch.device(device):
        wl = case.build(batch or case.batch, seq or case.seq)
    wl, opt, scaler = prepare(wl, device, case.precision, "none", case.compile)
    step = make_loop(loop, wl, opt, scaler, case.precision, device)
    for _ in range(warmup):
        step()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    row = {"step_s": statistics.median(times), "step_times": times}
    if device == "cuda":
        row |= {
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
        }
    return row


def predict(case_name: str, loop: str, batch, seq, gpu: str) -> dict:
    import gobrrr
    from zoo.cases import get_case

    case = get_case(case_name)
    est = gobrrr.estimate(
        case.factory(),
        gpu,
        batch=batch or case.batch,
        seq=seq or case.seq,
        precision=case.precision,
        compile=case.compile,
        loop=loop,
    )
    return {
        "loop": loop,
        "peak_allocated": est.memory.peak,
        "peak_reserved": est.memory.reserved,
        "step_s": est.time.step_s,
        "other_loop_peak_allocated": est.other_loop.peak if est.other_loop else None,
    }


# -- the parent --------------------------------------------------------------------------------


def _child(args, case: str, loop: str, batch, seq) -> dict:
    cmd = [sys.executable, str(HERE), "--one", case, loop, "--device", args.device]
    cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    cmd += [f"--batch={batch or 0}", f"--seq={seq or 0}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": {"type": "Timeout", "message": f"over {args.timeout} s"}}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        return {"error": {"type": "ChildFailed", "message": p.stderr[-2000:]}}
    return json.loads(lines[-1])


def _gpu(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "h100"


def versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for lib in ("transformers", "timm", "torchvision", "accelerate"):
        with contextlib.suppress(Exception):
            out[lib] = __import__(lib).__version__
    return out


def _chosen(names: str | None) -> list[tuple]:
    """(case, batch, seq) for `--cases`: CASES by default; "zoo" for every zoo and held-out
    case; a zoo case not in CASES runs at its own shape."""
    from zoo.cases import CASES as ZOO
    from zoo.cases import HOLDOUT, get_case

    if not names:
        return list(CASES)
    if names == "zoo":
        names = ",".join(c.name for c in (*ZOO, *HOLDOUT))
    shapes = {c[0]: c for c in CASES}
    return [shapes.get(n) or (get_case(n).name, None, None) for n in names.split(",")]


def run(args) -> dict:
    from zoo.cases import get_case

    chosen = _chosen(args.cases)
    data = {
        "version": VERSION,
        "device": _gpu(args.device) if args.device == "cuda" and not args.predict_only else "cpu",
        "versions": versions(),
        "tiny": args.tiny,
        "cases": {},
    }
    for name, batch, seq in chosen:
        if args.tiny:
            batch, seq = TINY["batch"], TINY["seq"] if get_case(name).seq else None
        case = get_case(name)
        if case.library == "timm" and "timm" not in data["versions"]:
            data["cases"][name] = {"error": "timm does not import"}
            continue
        rows = data["cases"][name] = {"batch": batch or case.batch, "seq": seq or case.seq}
        for loop in loops_for(case):
            if args.loops and loop not in args.loops.split(","):
                continue
            row = rows[loop] = {"not_modelled": NOT_MODELLED.get(loop)}
            if not args.predict_only:
                row["measured"] = _child(args, name, loop, batch, seq)
            if not args.measure_only:
                row["predicted"] = _predicted(name, PREDICTED_AS[loop], batch, seq, args)
            Path(args.out).write_text(json.dumps(data, indent=1))
            print(f"{name} {loop}: {row.get('measured', row.get('predicted'))}", file=sys.stderr)
    return data


def _predicted(name: str, loop: str, batch, seq, args) -> dict:
    """gobrrr's prediction of `name` under `loop` on the GPU measured (or `--gpu`)."""
    try:
        gpu = args.gpu or ("h100" if args.predict_only else _gpu(args.device))
        return predict(name, loop, batch, seq, gpu)
    except Exception as e:  # recorded, not fatal
        return {"error": f"{type(e).__name__}: {e}"}


def merge(out: str, parts: list[str]) -> dict:
    """One result from several runs' files (measured on several GPUs, predicted elsewhere):
    each (case, loop) row's keys joined; the first file's header kept."""
    data = None
    for part in parts:
        d = json.loads(Path(part).read_text())
        if data is None:
            data = {**d, "cases": {}}
        if d["device"] != "cpu":
            data["device"] = d["device"]
        for name, rows in d["cases"].items():
            mine = data["cases"].setdefault(name, {})
            for key, row in rows.items():
                if isinstance(row, dict) and isinstance(mine.get(key), dict):
                    mine[key] |= row
                else:
                    mine[key] = row
    Path(out).write_text(json.dumps(data, indent=1))
    return data


def summary(data: dict) -> list[dict]:
    """Per loop: the cases measured and predicted; the allocated peak's median |error|
    (predicted / measured - 1), how many within 1%, the most under and the most over; the
    reserved peak's median |error|, how many within 8% and the worst."""
    out = []
    for loop in PREDICTED_AS:
        errs, reserved = [], []
        for name, rows in data["cases"].items():
            r = rows.get(loop)
            if not isinstance(r, dict):
                continue
            m, p = r.get("measured") or {}, r.get("predicted") or {}
            if m.get("peak_allocated") and p.get("peak_allocated"):
                errs.append((p["peak_allocated"] / m["peak_allocated"] - 1, name))
            if m.get("peak_reserved") and p.get("peak_reserved"):
                reserved.append((p["peak_reserved"] / m["peak_reserved"] - 1, name))
        if errs:
            row = {
                "loop": loop,
                "predicted_as": PREDICTED_AS[loop],
                "cases": len(errs),
                "median_abs": statistics.median(abs(e) for e, _ in errs),
                "within_1pct": sum(abs(e) <= 0.01 for e, _ in errs),
                "most_under": min(errs),
                "most_over": max(errs),
            }
            if reserved:
                row |= {
                    "reserved_median_abs": statistics.median(abs(e) for e, _ in reserved),
                    "reserved_within_8pct": sum(abs(e) <= 0.08 for e, _ in reserved),
                    "reserved_worst": max(reserved, key=lambda x: abs(x[0])),
                }
            out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default="loops.json")
    p.add_argument("--cases", help="NAME,NAME of zoo cases, or zoo (default: CASES)")
    p.add_argument("--loops", help="LOOP,LOOP: only these of each case's loops")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help=f"every case at {TINY} (CPU dry run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--measure-only", action="store_true", help="no predictions")
    p.add_argument("--predict-only", action="store_true", help="no measurements (any host)")
    p.add_argument("--gpu", help="the GPU predictions are for (default: the one measured)")
    p.add_argument("--merge", nargs="+", metavar="PART", help="join PART files into OUT")
    p.add_argument("--summary", action="store_true", help="per loop, OUT's peaks against them")
    p.add_argument("--one", nargs=2, metavar=("CASE", "LOOP"), help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        try:
            row = measure(*args.one, args.device, args.batch, args.seq, args.warmup, args.steps)
        except Exception as e:
            oom = "out of memory" in str(e)
            tail = traceback.format_exc()[-1500:]
            row = {"error": {"type": type(e).__name__, "message": str(e)[:500], "oom": oom}}
            row["error"]["traceback"] = tail
        print(json.dumps(row))
        return 0
    if args.merge:
        merge(args.out, args.merge)
        return 0
    if args.summary:
        for row in summary(json.loads(Path(args.out).read_text())):
            print(json.dumps(row))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
