"""Host seconds per call of convolutions by kind and layout, on a GPU: what the calibration's
`op_host` ("convolution:bf16", a plain 3x3 on tiny tensors) stands for across the kinds real
CNNs run.

    PYTHONPATH=src python benchmarks/conv_host_kinds.py OUT.json

Kinds (tiny tensors, so the host is what a loop of calls waits on): a plain 3x3, depthwise
3x3 (stride 1 and 2) and 5x5, a grouped 3x3 (4 groups), a 1x1; each channels-first and
channels-last, bf16 and fp32, forward and backward (both gradients), and an elementwise add as
the baseline. Channels-first depthwise convolutions run PyTorch's own kernels, channels-last
ones cuDNN (ConvParams::use_cudnn_depthwise). Timed as gobrrr.calibrate.sections.host.per_call
does: 400 back-to-back calls after 20, least of 5 rounds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

VERSION = 1
#: kind -> (C_in, C_out, groups, kernel, stride)
KINDS = {"regular": (8, 8, 1, 3, 1), "depthwise": (32, 32, 32, 3, 1),
         "depthwise-s2": (32, 32, 32, 3, 2), "depthwise5": (32, 32, 32, 5, 1),
         "grouped": (32, 32, 4, 3, 1), "pointwise": (32, 64, 1, 1, 1)}


def cases(torch, dev):
    aten = torch.ops.aten
    for dtype, key in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for kind, (cin, cout, groups, k, s) in KINDS.items():
            for layout in ("channels_first", "channels_last"):
                x = torch.randn(2, cin, 8, 8, device=dev, dtype=dtype)
                w = torch.randn(cout, cin // groups, k, k, device=dev, dtype=dtype)
                if layout == "channels_last":
                    x = x.contiguous(memory_format=torch.channels_last)
                    w = w.contiguous(memory_format=torch.channels_last)
                args = ([s, s], [k // 2, k // 2], [1, 1], False, [0, 0], groups)
                gy = torch.randn_like(aten.convolution(x, w, None, *args))
                yield f"{kind}:{layout}:{key}:forward", (
                    lambda x=x, w=w, a=args: aten.convolution(x, w, None, *a))
                yield f"{kind}:{layout}:{key}:backward", (
                    lambda x=x, w=w, gy=gy, a=args: aten.convolution_backward(
                        gy, x, w, None, *a, [True, True, False]))
    a = torch.randn(8, device=dev)
    yield "add", lambda: aten.add(a, a)


def main(argv=None) -> int:
    import torch
    from bench_estimate_suite import environment

    from gobrrr.calibrate.sections.host import per_call

    out_path = (argv or sys.argv[1:])[0]
    dev = torch.device("cuda")
    per = {}
    for name, fn in cases(torch, dev):
        per[name] = per_call(fn, dev, 400, rounds=5, warmup=20)
        print(f"{name}: {per[name] * 1e6:.1f} us", flush=True)
    doc = {"version": VERSION, "environment": environment(),
           "cudnn": torch.backends.cudnn.version(), "per_call_s": per}
    Path(out_path).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
