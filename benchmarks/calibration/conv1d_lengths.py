"""Does a grouped 1-D convolution's speed follow its sequence length's alignment? wav2vec2's
position convolution (768 channels, 16 groups, kernel 128, padding 64, bf16) timed forward and
backward at batch 8 over lengths around 500 and 1000, with the kernels cuDNN ran.

    PYTHONPATH=src python benchmarks/calibration/conv1d_lengths.py OUT.json
"""

from __future__ import annotations

import torch

from gobrrr.calibrate.timing import time_op
from gobrrr.kernels.bench import cuda_kernels, gpu_out_arg, write_json

LENGTHS = (496, 499, 500, 511, 512, 999, 1000, 1024)


def main(argv=None) -> int:
    out = gpu_out_arg(__doc__, "conv1d_lengths", argv)
    if out is None:
        return 2
    dev, aten, rows = torch.device("cuda"), torch.ops.aten, []
    w = torch.randn(768, 48, 128, device=dev, dtype=torch.bfloat16) * 0.05
    args_ = ([1], [64], [1], False, [0], 16)
    for n in (8,):
        for length in LENGTHS:
            x = torch.randn(n, 768, length, device=dev, dtype=torch.bfloat16)
            y = aten.convolution(x, w, None, *args_)
            gy = torch.randn_like(y)
            fwd = lambda x=x: aten.convolution(x, w, None, *args_)  # noqa: E731
            bwd = lambda x=x, gy=gy: aten.convolution_backward(  # noqa: E731
                gy, x, w, None, *args_, [True, True, False]
            )
            row = {
                "batch": n,
                "length": length,
                "forward_s": time_op(fwd, dev, 10),
                "backward_s": time_op(bwd, dev, 10),
                "flops_forward": 2.0 * y.numel() * 48 * 128,
            }
            row["forward_kernels"] = sorted({name[:120] for name, _ in cuda_kernels(fwd)})
            row["forward_tflops"] = row["flops_forward"] / row["forward_s"] / 1e12
            rows.append(row)
            print({k: v for k, v in row.items() if k != "forward_kernels"}, flush=True)
    write_json(out, {"benchmark": "grouped conv1d lengths", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
