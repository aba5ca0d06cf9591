"""Which SDPA backend CUDA runs, and what it allocates, over a grid of attention calls.

    python benchmarks/kernels/sdpa_backends.py OUT.json

For each case (dtype, head dim, heads and KV heads, sequence lengths, mask kind, dropout, causal,
autocast): F.scaled_dot_product_attention forward and backward on the GPU under a dispatch mode
that records every ATen op with its outputs' shapes and dtypes (so the backend CUDA chose is
known), and the allocator's counters around each direction: the peak above what was allocated
before the call (`fwd_peak`, `bwd_peak`), what stays allocated after it (`fwd_kept`,
`bwd_kept`). What an op allocates and frees inside itself (workspaces, fp32 accumulators) is the
peak less the op's visible outputs; `gobrrr`'s memory model is checked against these records by
`tests/test_sdpa_backends.py`.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        self.ops.append(
            {
                "op": str(func.overloadpacket.__name__) + "." + func._overloadname,
                "out": [
                    [list(t.shape), list(t.stride()), str(t.dtype).replace("torch.", "")]
                    for t in flat
                    if isinstance(t, torch.Tensor)
                ],
            }
        )
        return out


def _mask(kind: str, b: int, sq: int, sk: int, dtype: torch.dtype):
    if kind == "none":
        return None
    keep = torch.ones(b, 1, sq, sk, dtype=torch.bool, device="cuda")
    keep[:, :, :, sk - sk // 4 :] = False  # the last quarter of the keys padded
    keep[:, :, :, 0] = True
    if kind == "bool":
        return keep
    m = torch.zeros(b, 1, sq, sk, dtype=dtype, device="cuda")
    return m.masked_fill(~keep, torch.finfo(dtype).min)


def run_case(c: dict) -> dict:
    dt = getattr(torch, c["dtype"])
    b, hq, hk, sq, sk, d = c["b"], c["hq"], c["hk"], c["sq"], c["sk"], c["d"]
    mk = dict(device="cuda", dtype=torch.float32 if c["autocast"] else dt, requires_grad=True)
    # (B, S, H, D) projections viewed as (B, H, S, D), as transformer blocks make them
    q = torch.randn(b, sq, hq, d, **mk).transpose(1, 2).detach().requires_grad_()
    k = torch.randn(b, sk, hk, d, **mk).transpose(1, 2).detach().requires_grad_()
    v = torch.randn(b, sk, hk, d, **mk).transpose(1, 2).detach().requires_grad_()
    mask = _mask(c["mask"], b, sq, sk, dt)
    kw = dict(attn_mask=mask, dropout_p=c["dropout"], is_causal=c["causal"])
    if hq != hk:
        kw["enable_gqa"] = True
    rec: dict = {}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with _Ops() as fwd_ops:
        with torch.autocast("cuda", dtype=dt, enabled=c["autocast"]):
            out = F.scaled_dot_product_attention(q, k, v, **kw)
    torch.cuda.synchronize()
    rec["fwd_peak"] = torch.cuda.max_memory_allocated() - base
    rec["fwd_kept"] = torch.cuda.memory_allocated() - base
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    base2 = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with _Ops() as bwd_ops:
        out.backward(grad)
    torch.cuda.synchronize()
    rec["bwd_peak"] = torch.cuda.max_memory_allocated() - base2
    rec["bwd_kept"] = torch.cuda.memory_allocated() - base2
    rec["out"] = [list(out.shape), list(out.stride()), str(out.dtype)]
    rec["fwd_ops"], rec["bwd_ops"] = fwd_ops.ops, bwd_ops.ops
    return rec


def cases() -> list[dict]:
    out = []
    base = dict(
        b=4,
        hq=12,
        hk=12,
        sq=1024,
        sk=1024,
        d=64,
        dtype="bfloat16",
        mask="none",
        dropout=0.0,
        causal=True,
        autocast=True,
    )
    variants = [
        {},
        {"causal": False},
        {"dropout": 0.1},
        {"dropout": 0.125},
        {"mask": "bool", "causal": False},
        {"mask": "bool", "causal": False, "dropout": 0.1},
        {"mask": "float", "causal": False},
        {"d": 128, "hq": 16, "hk": 16},
        {"d": 128, "hq": 32, "hk": 8},
        {"d": 128, "hq": 32, "hk": 8, "dropout": 0.1},
        {"d": 80, "hq": 16, "hk": 16},
        {"d": 96, "hq": 16, "hk": 16},
        {"d": 256, "hq": 8, "hk": 8},
        {"d": 72, "hq": 16, "hk": 16},
        {"dtype": "float32", "autocast": False},
        {"dtype": "float32", "autocast": False, "mask": "bool", "causal": False},
        {"dtype": "float32", "autocast": False, "dropout": 0.1},
        {"dtype": "bfloat16", "autocast": False},
        {"dtype": "bfloat16", "autocast": False, "mask": "bool", "causal": False},
        {"sq": 1000, "sk": 1000},
        {"sq": 197, "sk": 197, "causal": False, "b": 32},
        {"sq": 197, "sk": 197, "causal": False, "b": 32, "dropout": 0.1},
        {"sq": 1500, "sk": 1500, "causal": False, "b": 8, "hq": 8, "hk": 8},
        {"sq": 448, "sk": 1500, "causal": False, "b": 8, "hq": 8, "hk": 8},
        {"sq": 512, "sk": 512, "mask": "bool", "causal": False, "b": 16},
        {"d": 128, "hq": 16, "hk": 16, "mask": "bool", "causal": False},
        {"d": 64, "hq": 12, "hk": 12, "sq": 2048, "sk": 2048, "b": 2},
        {
            "d": 128,
            "hq": 16,
            "hk": 4,
            "sq": 2048,
            "sk": 2048,
            "b": 2,
            "mask": "bool",
            "causal": False,
        },
    ]
    for v in variants:
        out.append({**base, **v})
    return out


def environment() -> dict:
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "capability": list(torch.cuda.get_device_capability()),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def main(path: str) -> None:
    results = []
    for c in cases():
        try:
            r = run_case(c)
        except Exception as e:  # recorded, not fatal: some combinations have no backend
            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        torch.cuda.empty_cache()
        attn = [o["op"] for o in r.get("fwd_ops", []) if "attention" in o["op"]]
        print(c, "->", attn or r.get("error"), r.get("fwd_peak"), r.get("bwd_peak"), flush=True)
        results.append({"case": c, **r})
    with open(path, "w") as f:
        json.dump({"version": 1, "environment": environment(), "results": results}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python benchmarks/kernels/sdpa_backends.py OUT.json")
    main(sys.argv[1])
