"""What holds the HF Trainer's peak for a masked-LM encoder in bf16: Accelerate's fp32 copy of
the model's output, measured under `Trainer.training_step` with and without that copy.

    PYTHONUNBUFFERED=1 python benchmarks/zoo/trainer_fp32_outputs.py $OUT/trainer_fp32.json
    python benchmarks/zoo/trainer_fp32_outputs.py /tmp/t.json --device cpu --tiny   # dry run

With mixed precision, `Accelerator.prepare_model` (accelerate 1.15, accelerator.py:1835) wraps
the model's forward in `convert_outputs_to_fp32`: what the forward returned goes through
`convert_to_fp32` (utils/operations.py:889), which makes a `.float()` copy of every fp16/bf16
tensor it reaches through tuples, lists and dicts (HF's ModelOutput is one) while the bf16
originals are still alive. For an MLM the logits are bf16 [b, s, vocab]: for a moment the
forward's saved activations, the loss's fp32 log-probabilities, the bf16 logits and their fp32
copy are all alive.

Each case (a zoo case, built seeded on the device, prepared as gobrrr's profile runner does)
runs in this process under three loops, each 3 warm-up steps then `--steps` measured:

- trainer: a real `transformers.Trainer` stepped as `benchmarks/zoo/loops.py` steps it;
- trainer-no-fp32-copy: the same, with Accelerate's fp32 wrapper taken off the forward (the
  autocast wrapper kept), as `accelerate.utils.extract_model_from_parallel(...,
  keep_fp32_wrapper=False)` does;
- plain: `out = model(**batch)` kept through backward (loops.py's plain loop).

Printed and written per (case, loop): `max_memory_allocated` over the measured steps, and the
same split at the end of `compute_loss` (forward and output conversion) and over backward
and the optimizer step; for the trainer loops, what `convert_to_fp32` saw on the last step:
bytes allocated as it was called, the bytes of the fp16/bf16 tensors it copied, and the
peak reached by its return. gobrrr's prediction of each loop is added where this gobrrr
knows it (`--no-predict` to skip). torch 2.11, transformers 5.17, accelerate 1.15; no network.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from types import MethodType

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2]), str(HERE.parent)]

import torch  # noqa: E402
from loops import hf_trainer_loop, plain_loop, versions  # noqa: E402

#: (zoo case, batch, seq): two MLM encoders that miss under "drops-output" and a decoder LM
#: that does not (its loss upcasts the logits itself; see the investigation)
CASES = [("bert-base-mlm", 32, 512), ("distilbert-mlm", 32, 512), ("qwen2-0.5b", 8, 1024)]
TINY = {"batch": 2, "seq": 32}
LOOPS = ("trainer", "trainer-no-fp32-copy", "plain")
#: gobrrr's loop for each (the one this gobrrr predicts it with)
PREDICTED_AS = {
    "trainer": "hf-trainer",
    "trainer-no-fp32-copy": "drops-output",
    "plain": "keeps-output",
}


class Meter:
    """Peak allocated bytes between marks (CUDA only; zeros on the CPU)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def now(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0


def watch_conversion(meter: Meter) -> dict:
    """Wrap accelerate's `convert_to_fp32` (looked up by ConvertOutputsToFp32.__call__ at call
    time) to record, on each call, the bytes allocated on entry, the fp16/bf16 tensor bytes it
    copies and the peak by its return. Returns the dict it fills."""
    import accelerate.utils.operations as ops

    seen: dict = {}
    original = ops.convert_to_fp32

    def convert(tensor):
        low = []
        ops.recursively_apply(
            lambda t: low.append(t.numel() * t.element_size()),
            tensor,
            test_type=lambda t: isinstance(t, torch.Tensor) and t.dtype in LOW,
        )
        seen.update(calls=seen.get("calls", 0) + 1, allocated_before=meter.now())
        seen.update(low_bytes=sum(low), tensors=len(low))
        out = original(tensor)
        seen.update(allocated_after=meter.now(), peak_by_return=meter.peak())
        return out

    ops.convert_to_fp32 = convert
    seen["restore"] = lambda: setattr(ops, "convert_to_fp32", original)
    return seen


LOW = (torch.float16, torch.bfloat16)


def without_fp32_copy(model) -> None:
    """Take Accelerate's ConvertOutputsToFp32 off `model.forward`, keeping its autocast."""
    wrapper = model.forward.__func__.__wrapped__  # convert_outputs_to_fp32's `forward`
    model.forward = MethodType(wrapper.model_forward, model)


def split_step(loop: str, wl, opt, precision: str, device: str, meter: Meter):
    """(step, marks): one step of `loop`, recording the peak up to the loss (the forward and,
    for the Trainer, compute_loss's output conversion) and after it (backward, optimizer)."""
    marks: dict = {}
    if loop == "plain":
        step = plain_loop(wl, opt, precision, device)
        return step, marks
    step = hf_trainer_loop(wl, opt, precision, device)
    trainer = step.trainer
    if loop == "trainer-no-fp32-copy":
        without_fp32_copy(trainer.model_wrapped)
    compute_loss = trainer.compute_loss

    def measured_compute_loss(*a, **k):
        loss = compute_loss(*a, **k)
        marks["to_loss"] = meter.peak()  # forward + conversion, the outputs not yet dropped
        meter.reset()
        return loss

    trainer.compute_loss = measured_compute_loss
    return step, marks


def run_one(case_name: str, loop: str, batch: int, seq: int, args) -> dict:
    from gobrrr.profile.runner import prepare
    from zoo.cases import get_case

    case = get_case(case_name)
    batch, seq = batch or case.batch, seq or case.seq
    meter = Meter(args.device)
    torch.manual_seed(0)
    with torch.device(args.device):
        wl = case.build(batch, seq)
    wl, opt, _ = prepare(wl, args.device, case.precision, "none", case.compile)
    step, marks = split_step(loop, wl, opt, case.precision, args.device, meter)
    seen = watch_conversion(meter) if loop != "plain" else {}
    try:
        for _ in range(3):
            step()
        peaks, rest = [], []
        for _ in range(args.steps):
            meter.reset()
            t = time.perf_counter()
            step()
            rest.append(meter.peak())
            peaks.append(max(marks.get("to_loss", 0), rest[-1]))
            dt = time.perf_counter() - t
    finally:
        if "restore" in seen:
            seen.pop("restore")()
    row = {"peak_allocated": max(peaks), "to_loss_peak": marks.get("to_loss")}
    row |= {"after_loss_peak": max(rest) if loop != "plain" else None, "last_step_s": dt}
    row["conversion"] = seen or None
    return row


def predict(case_name: str, loop: str, batch: int, seq: int, gpu: str) -> dict:
    import gobrrr
    from zoo.cases import get_case

    case = get_case(case_name)
    est = gobrrr.estimate(
        case.factory(), gpu, batch=batch, seq=seq, precision=case.precision, loop=loop
    )
    return {"loop": loop, "peak_allocated": est.memory.peak}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--cases", help="NAME[:BATCH:SEQ],... (default: %(default)s)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help=f"every case at {TINY} (CPU dry run)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--no-predict", action="store_true")
    args = p.parse_args(argv)
    chosen = CASES
    if args.cases:
        chosen = [(*c.split(":")[:1], *map(int, c.split(":")[1:])) for c in args.cases.split(",")]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    data = {"device": gpu, "versions": versions(), "tiny": args.tiny, "cases": {}}
    for name, *shape in chosen:
        batch, seq = (TINY["batch"], TINY["seq"]) if args.tiny else (*shape, None, None)[:2]
        rows = data["cases"][name] = {"batch": batch, "seq": seq}
        for loop in LOOPS:
            try:
                row = run_one(name, loop, batch, seq, args)
            except Exception as e:  # recorded, not fatal
                row = {"error": f"{type(e).__name__}: {e}"[:800]}
            if not args.no_predict:
                try:
                    row["predicted"] = predict(name, PREDICTED_AS[loop], batch, seq, "h100")
                except Exception as e:
                    row["predicted"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows[loop] = row
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print(f"{name} b{batch} s{seq} {loop}: {json.dumps(row)}", flush=True)
            Path(args.out).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
