"""One-off: which gradient sums the autograd engine makes in place (aten::add_) or not
(aten::add) in timm's ConvNeXt-T backward, on the device given, for variants of the zoo case
(grad checkpointing, stochastic depth, autocast), from the profiler's ops with their shapes.

    PYTHONPATH=src:. python benchmarks/zoo/gradient_sums.py cuda OUT.json 64
"""
import sys, collections, json
sys.path[:0]=['src','.']
import torch
import torch.nn.functional as F
import timm
from torch.profiler import profile, ProfilerActivity
dev = sys.argv[1]; out = sys.argv[2]; B = int(sys.argv[3])
res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__, "timm": timm.__version__, "B": B, "variants": {}}
for gc in (True, False):
    for dp in (0.1, 0.0):
        for ac in (True, False):
            torch.manual_seed(0)
            m = timm.create_model("convnext_tiny", drop_path_rate=dp).to(dev)
            if gc: m.set_grad_checkpointing(True)
            m.train()
            x = torch.randn(B, 3, 224, 224, device=dev); y = torch.randint(0, 1000, (B,), device=dev)
            opt = torch.optim.AdamW(m.parameters())
            def fwd():
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=ac):
                    return F.cross_entropy(m(x), y)
            for _ in range(2):
                fwd().backward(); opt.step(); opt.zero_grad()
            loss = fwd()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            with profile(activities=acts, record_shapes=True) as prof:
                loss.backward()
                if dev == "cuda": torch.cuda.synchronize()
            c = collections.Counter()
            for e in prof.events():
                if e.name in ("aten::add", "aten::add_") and e.input_shapes and len(e.input_shapes[0]) == 4 and e.input_shapes[0][0] == B:
                    dt = e.input_dtypes[0] if getattr(e, "input_dtypes", None) else ""
                    c[f"{e.name} {tuple(e.input_shapes[0])} {dt}"] += 1
            res["variants"][f"gc={gc} drop_path={dp} autocast={ac}"] = dict(sorted(c.items()))
            del m, opt, loss
json.dump(res, open(out, "w"), indent=1)
for k, v in res["variants"].items(): print(k, v)
