"""Applied step vs the same configuration written by hand, ViT-L/16, mb 256 x 2, bf16-mixed:
alternating timing, and one profiled step of each (aten::to device time, shapes, kernels)."""
import json, os, sys, statistics, time
sys.path[:0] = ["src", "."]
import torch, torch.nn.functional as F
from zoo.vision import torchvision_model
from gobrrr.plan.apply import apply
from gobrrr.plan.knobs import Knobs

out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
arch = sys.argv[1] if len(sys.argv) > 1 else "vit_l_16"
mb, acc = int(sys.argv[2]) if len(sys.argv) > 2 else 256, 2
w = torchvision_model(mb * acc, None, arch=arch)
w.model.cuda()
cpu_batch = w.batch  # the workload's own batch stays on the host, as zoo workloads build it
step = apply(w, Knobs(micro_batch=mb, accumulation=acc), "bf16-mixed")
model = w.model
opt = torch.optim.AdamW(model.parameters())
images, labels = (t.cuda() for t in cpu_batch)

def hand():
    for x, y in zip(images.chunk(acc), labels.chunk(acc)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y) / acc
        loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)

def applied():
    step()

def applied_copy_each():  # what step() did before: the host batch moved on every step
    step(cpu_batch)

def timeit(fn, n=4):
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
    return ts

for fn in (hand, applied, applied_copy_each, hand, applied):
    fn()
torch.cuda.synchronize()
times = {"hand": [], "applied": [], "applied_copy_each": []}
for _ in range(3):
    times["hand"] += timeit(hand, 2); times["applied"] += timeit(applied, 2)
    times["applied_copy_each"] += timeit(applied_copy_each, 2)
out["times"] = times
out["median"] = {k: statistics.median(v) for k, v in times.items()}
from torch.profiler import profile, ProfilerActivity
prof_out = {}
for name, fn in (("hand", hand), ("applied", applied), ("applied_copy_each", applied_copy_each)):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        fn(); torch.cuda.synchronize()
    rows = []
    for ev in p.key_averages(group_by_input_shape=True):
        if ev.key in ("aten::to", "aten::_to_copy", "aten::copy_"):
            rows.append({"op": ev.key, "shapes": str(ev.input_shapes)[:160], "count": ev.count,
                         "device_us": ev.device_time_total})
    rows.sort(key=lambda r: -r["device_us"])
    kern = sorted(({"k": ev.key[:140], "count": ev.count, "device_us": ev.device_time_total}
                   for ev in p.key_averages() if ev.device_type.name == "CUDA"),
                  key=lambda r: -r["device_us"])
    prof_out[name] = {"casts": rows[:25], "kernels": kern[:40],
                      "total_device_us": sum(r["device_us"] for r in kern)}
out["profile"] = prof_out
o = os.environ.get("OUT", "/tmp")
json.dump(out, open(f"{o}/apply_vs_hand_{arch}.json", "w"), indent=1)
print(json.dumps(out["median"]))
for name in prof_out:
    print(name, prof_out[name]["total_device_us"])
    for r in prof_out[name]["casts"][:8]: print("  ", r)
