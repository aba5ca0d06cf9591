"""Host issue time and device time per phase (forward, backward, optimizer) of checkpointed and
plain steps, beside gobrrr's predicted host and device seconds per phase.

    PYTHONPATH=src:.:benchmarks/zoo python benchmarks/zoo/lora_host_phases.py OUT.json CASE...
CASE: a qlora.py case (qwen2-0.5b-lora-gc, ...) or a zoo case (gpt2-124m-gc, ...).
Per step: perf_counter at each phase's entry and exit on the host and a CUDA event at each,
synchronised only at the step's end. A phase's host time is its issue time; where the device
events trail the host's by the phase's own length, the host set the pace.
"""

import contextlib
import json
import statistics
import sys
import time
import traceback
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT / "src"), str(_ROOT), str(_ROOT / "benchmarks" / "zoo")]
import gobrrr  # noqa: E402
from gobrrr.profile.runner import prepare  # noqa: E402
from gobrrr.training.step import TrainStep  # noqa: E402


def predicted(est):
    host, dev, n = defaultdict(float), defaultdict(float), defaultdict(int)
    for o in est.time.ops:
        host[o.phase] += o.host_s
        dev[o.phase] += o.device_s
        n[o.phase] += 1
    return {"step_s": est.time.step_s, "host_s": dict(host), "device_s": dict(dev), "ops": dict(n)}


def build(name, device):
    if "lora" in name:
        import qlora as Q

        fam, four, gc = Q.parse_case(name)
        vocab = Q.config(fam, False).vocab_size
        mk = lambda: Q.workload(
            Q.adapt(Q.base_in_memory(fam, four, False), four, gc), vocab, 4, 2048
        )
        est = gobrrr.estimate(mk, gpu="h100", precision="bf16-mixed", loop="drops-output")
        if device != "cuda":
            return est, None
        torch.manual_seed(0)
        m = Q.base_from_checkpoint(fam, four, False, __import__("pathlib").Path("/tmp/gq"), device)
        wl = Q.workload(Q.adapt(m, four, gc), m.config.vocab_size, 4, 2048, device)
        return est, (wl, "bf16-mixed")
    from zoo import compare
    from zoo.cases import get_case

    c = get_case(name)
    est = compare.predict(c)
    if device != "cuda":
        return est, None
    torch.manual_seed(0)
    with torch.device(device):
        wl = c.build(c.batch, c.seq)
    return est, (wl, c.precision)


def measure(wl, precision, steps=12, warm=3):
    wl, opt, scaler = prepare(wl, "cuda", precision)
    marks = []

    @contextlib.contextmanager
    def phase(name):
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        yield
        e1 = torch.cuda.Event(enable_timing=True)
        e1.record()
        t1 = time.perf_counter()
        marks.append((name, t0, t1, e0, e1))

    step = TrainStep(
        wl, opt, precision, device_type="cuda", scaler=scaler, phase=phase, keep_loss=False
    )
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    rows = []
    for _ in range(steps):
        marks.clear()
        s0 = torch.cuda.Event(enable_timing=True)
        s0.record()
        h0 = time.perf_counter()
        step()
        h1 = time.perf_counter()
        s1 = torch.cuda.Event(enable_timing=True)
        s1.record()
        torch.cuda.synchronize()
        h2 = time.perf_counter()
        r = {"host_issue_s": h1 - h0, "wall_s": h2 - h0, "device_s": s0.elapsed_time(s1) / 1e3}
        for name, t0, t1, e0, e1 in marks:
            r[f"host:{name}"] = r.get(f"host:{name}", 0) + (t1 - t0)
            r[f"dev:{name}"] = r.get(f"dev:{name}", 0) + e0.elapsed_time(e1) / 1e3
            # how far the device trails the host at the phase's end
            r[f"lag_end:{name}"] = s0.elapsed_time(e1) / 1e3 - (t1 - h0)
        rows.append(r)
    keys = rows[0].keys()
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "cases": {},
    }
    for name in cases:
        row = {}
        try:
            est, built = build(name, dev)
            row["predicted"] = predicted(est)
            if built:
                row["measured"] = measure(*built)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["tb"] = traceback.format_exc()[-1500:]
        res["cases"][name] = row
        print(name, json.dumps(row)[:1500], flush=True)
        torch.cuda.empty_cache() if dev == "cuda" else None
        open(out, "w").write(json.dumps(res, indent=1))


main()
