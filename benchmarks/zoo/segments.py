"""One-off: four steps of a zoo case under a loop with the allocator's history (C++ and
Python frames): every segment mapped (its size, the allocation that asked for it and that
allocation's frames), the largest transient allocations, and each step's peaks.

    PYTHONPATH=src:. python benchmarks/zoo/segments.py CASE LOOP OUT.json
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
res = {"case": case_name, "loop": loop, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
       "cudnn": torch.backends.cudnn.version(), "steps": []}
torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="all")
for k in range(4):
    torch.cuda.reset_peak_memory_stats()
    step(); torch.cuda.synchronize()
    res["steps"].append({"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
                         "reserved_after": torch.cuda.memory_reserved()})
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
events = snap["device_traces"][0]
def frames(e, n=8):
    fr = e.get("frames", [])
    py = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}" for f in fr if f["filename"].endswith(".py")][:4]
    cc = [f["name"][:90] for f in fr if not f["filename"].endswith(".py") and any(s in f["name"] for s in ("cudnn", "conv", "native::", "at::", "Workspace", "workspace"))][:n]
    return {"py": py, "cpp": cc}
segs = []
for i, e in enumerate(events):
    if e["action"] == "segment_alloc":
        nxt = next((x for x in events[i + 1:i + 4] if x["action"] == "alloc"), None)
        segs.append({"event": i, "size": e["size"], "next_alloc": nxt and nxt["size"], "frames": frames(e)})
live = {}
trans = []
for i, e in enumerate(events):
    if e["action"] == "alloc":
        live[e["addr"]] = (i, e)
    elif e["action"] == "free_completed" and e["addr"] in live:
        j, a = live.pop(e["addr"])
        if i - j <= 6 and a["size"] >= 4 << 20:
            trans.append({"event": j, "size": a["size"], "lived_events": i - j, "frames": frames(a)})
trans.sort(key=lambda t: -t["size"])
res["segments"] = segs
res["transient_over_4MiB"] = trans[:80]
res["events"] = len(events)
json.dump(res, open(out, "w"), indent=1)
print(case_name, loop, res["steps"], len(segs), len(trans))
