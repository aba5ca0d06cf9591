"""One-off: one step of a zoo case under a loop (benchmarks/zoo/loops.py's), with the allocator's
history: the blocks alive at the step's allocated peak by the Python frames that allocated
them, every allocation of 20 MB or more, and a profile of three steps' kernels.

    PYTHONPATH=src:. python benchmarks/zoo/live_at_peak.py CASE LOOP OUT.json
"""
import json, sys, collections
import torch
sys.path[:0] = ["src", "."]
from benchmarks.zoo.loops import make_loop
from gobrrr.profile.runner import prepare
from zoo.cases import get_case

case_name, loop, out = sys.argv[1], sys.argv[2], sys.argv[3]
case = get_case(case_name)
torch.manual_seed(0)
with torch.device("cuda"):
    wl = case.build(case.batch, case.seq)
wl, opt, scaler = prepare(wl, "cuda", case.precision, "none", case.compile)
step = make_loop(loop, wl, opt, scaler, case.precision, "cuda")
for _ in range(3):
    step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
step()
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
peak = torch.cuda.max_memory_allocated()
events = snap["device_traces"][0]
live = {}
cur = base
best = (cur, -1, {})
for i, e in enumerate(events):
    if e["action"] == "alloc":
        live[e["addr"]] = e
        cur += e["size"]
        if cur > best[0]:
            best = (cur, i, dict(live))
    elif e["action"] == "free_completed":
        live.pop(e["addr"], None)
        cur -= e["size"]
def where(e):
    fr = [f for f in e.get("frames", []) if f["filename"].endswith(".py") and "/torch/" not in f["filename"]]
    return " <- ".join(f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}" for f in fr[:5])
rows = sorted(best[2].values(), key=lambda e: -e["size"])
by = collections.Counter()
for e in rows:
    by[where(e)] += e["size"]
res = {"case": case_name, "loop": loop, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
       "peak_allocated": peak, "base_allocated_before_step": base, "replayed_peak": best[0], "peak_event": best[1],
       "live_in_step": [{"bytes": e["size"], "where": where(e)} for e in rows[:60]],
       "over_20MB": [{"bytes": e["size"], "where": where(e)} for e in events if e["action"] == "alloc" and e["size"] >= 20e6][:400],
       "by_where": [{"bytes": b, "where": w} for w, b in by.most_common(40)],
       "events": len(events)}
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
tot = collections.Counter(); cnt = collections.Counter()
for k in ks:
    tot[k.name] += k.device_time; cnt[k.name] += 1
spans = sorted((k.time_range.start, k.time_range.end) for k in ks)
busy = 0; end = -1
for a, b in spans:
    if b > end:
        busy += b - max(a, end); end = b
import time
ts = []
for _ in range(10):
    torch.cuda.synchronize(); t = time.perf_counter(); step(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
res["profile"] = {"steps": 3, "kernels": len(ks), "kernel_us_sum": sum(tot.values()), "busy_us": busy,
    "wall_span_us": (spans[-1][1] - spans[0][0]) if spans else 0,
    "top": [{"name": n[:120], "us": u, "calls": cnt[n]} for n, u in tot.most_common(40)],
    "step_s_after": sorted(ts)[len(ts)//2]}
json.dump(res, open(out, "w"), indent=1)
print(case_name, loop, peak, best[0], len(rows))
