"""One-off: a zoo case under the plain loop, one step under the allocator's history with a
marker allocation at each phase boundary; the blocks alive at the peak with their Python
frames; every allocation of 20 MB or more with its frames and the event that freed it; the
Inductor source files those frames name, in a .tar.gz beside OUT.

    PYTHONPATH=src:. python benchmarks/zoo/live_at_peak_phases.py CASE OUT.json
"""
import json, sys, collections
import torch
sys.path[:0] = ["src", "."]
from benchmarks.zoo.loops import _output, _loss
from gobrrr.profile.runner import prepare
from zoo.cases import get_case
from benchmarks.zoo import loops as L

case_name, out = sys.argv[1], sys.argv[2]
case = get_case(case_name)
torch.manual_seed(0)
with torch.device("cuda"):
    wl = case.build(case.batch, case.seq)
wl, opt, scaler = prepare(wl, "cuda", case.precision, "none", case.compile)
MARK = {}
def mark(name, k):
    MARK[name] = 512 * k
    t = torch.empty(512 * k, dtype=torch.uint8, device="cuda"); del t
state = {"out": None}
def step(marks=False):
    if marks: mark("start", 7001)
    with L.autocast_for(case.precision, "cuda"):
        state["out"] = _output(wl, wl.batch)
        if marks: mark("forward_returned", 7003)
        loss = _loss(wl, state["out"], wl.batch)
    if marks: mark("loss", 7005)
    loss.backward()
    if marks: mark("backward_done", 7007)
    opt.step()
    if marks: mark("opt_done", 7009)
    opt.zero_grad()
for _ in range(3):
    step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
step(marks=True)
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
peak = torch.cuda.max_memory_allocated()
events = snap["device_traces"][0]
sizes = {v: k for k, v in MARK.items()}
marks = {}
for i, e in enumerate(events):
    if e["action"] == "alloc" and e["size"] in sizes and sizes[e["size"]] not in marks:
        marks[sizes[e["size"]]] = i
def phase(i):
    ph = "before"
    for k, j in sorted(marks.items(), key=lambda x: x[1]):
        if i >= j: ph = k
    return ph
def where(e):
    fr = [f for f in e.get("frames", []) if f["filename"].endswith(".py") and "/torch/" not in f["filename"]]
    tf = [f for f in e.get("frames", []) if f["filename"].endswith(".py")]
    s = " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in fr[:4])
    t = " <- ".join(f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}" for f in tf[:3])
    return s + " || " + t
live = {}; cur = base; best = (cur, -1, {})
born = {}
bigs = []
for i, e in enumerate(events):
    if e["action"] == "alloc":
        live[e["addr"]] = (i, e); cur += e["size"]
        if e["size"] >= 20e6:
            bigs.append({"bytes": e["size"], "alloc_event": i, "alloc_phase": phase(i), "where": where(e), "addr": e["addr"]})
        if cur > best[0]: best = (cur, i, dict(live))
    elif e["action"] == "free_completed":
        live.pop(e["addr"], None); cur -= e["size"]
        for b in bigs:
            if b["addr"] == e["addr"] and "free_event" not in b and b["alloc_event"] < i:
                b["free_event"] = i; b["free_phase"] = phase(i); b["free_where"] = where(e)
for b in bigs: b.pop("addr")
rows = sorted(best[2].values(), key=lambda x: -x[1]["size"])
res = {"case": case_name, "loop": "plain", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
       "peak_allocated": peak, "base_allocated_before_step": base, "replayed_peak": best[0],
       "peak_event": best[1], "peak_phase": phase(best[1]), "marks": marks, "events": len(events),
       "live_at_peak": [{"bytes": e["size"], "alloc_event": i, "alloc_phase": phase(i), "where": where(e)} for i, e in rows[:40]],
       "allocations_over_100MB": bigs}
json.dump(res, open(out, "w"), indent=1)
import glob, tarfile, os
names = set()
for b in bigs:
    for part in (b["where"] + " " + b.get("free_where", "")).split():
        if part.endswith(".py") or ".py:" in part:
            names.add(part.split(":")[0].split("/")[-1])
files = [f for f in glob.glob("/tmp/torchinductor_root/**/*.py", recursive=True) if os.path.basename(f) in names]
with tarfile.open(out.replace(".json", "_code.tar.gz"), "w:gz") as t:
    for f in files:
        t.add(f, arcname=os.path.basename(f))
print("code files", len(files))
print(case_name, peak, best[0], phase(best[1]), marks)
