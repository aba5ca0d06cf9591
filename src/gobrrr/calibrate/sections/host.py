"""Host-side calibration: what an eager training step costs the host per op (per phase, and
under activation checkpointing), and what some ops cost it beyond an ordinary one.

Timed with the host's clock on tiny inputs, so that the host, not the GPU, is what each loop
waits on.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from gobrrr.calibrate.sections.step import PHASES
from gobrrr.capture import capture
from gobrrr.cost.shapes import checkpointed_modules
from gobrrr.models.registry import get_workload
from gobrrr.profile.runner import prepare
from gobrrr.profile.timing import sync
from gobrrr.training.checkpointing import apply_checkpointing, block_names
from gobrrr.training.optimizers import optimizer_key


def _tiny_workloads():
    yield lambda: get_workload(
        "gpt2", batch_size=1, seq_len=16, n_layer=4, n_embd=64, n_head=4, vocab_size=128
    )
    yield lambda: get_workload(
        "llama3-1b",
        batch_size=1,
        seq_len=16,
        n_layer=4,
        dim=64,
        n_head=4,
        n_kv_head=2,
        ffn_dim=128,
        vocab_size=128,
    )


def _tiny_lora():
    """The tiny Llama LoRA'd as peft's default recipe does it: every weight frozen, q_proj and
    v_proj given trainable rank-4 adapters (`_LoRA`). Its checkpointed ops save about 0.3
    tensors an op, against 0.4 in the tiny Llama and 0.9 in the tiny GPT-2, so the three
    together tell a surcharge per op from one per saved tensor."""
    wl = list(_tiny_workloads())[1]()
    wl.model.requires_grad_(False)
    for block in wl.model.layers:
        for name in ("q_proj", "v_proj"):
            setattr(block.self_attn, name, _LoRA(getattr(block.self_attn, name)))
    return wl


class _LoRA(torch.nn.Module):
    """A frozen linear plus a trainable low-rank update, as peft's LoRA layer runs it:
    base(x) + B(A(x)) * scale."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4, scale: float = 2.0):
        super().__init__()
        self.base, self.scale = base.requires_grad_(False), scale
        self.lora_a = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


def _fit_workloads():
    """(name, make) of the tiny models the checkpoint surcharge is fitted on: the two whose
    pooled per-op figures `step_overhead` records, and the LoRA'd one."""
    yield from zip(("gpt2", "llama3"), _tiny_workloads(), strict=True)
    yield "llama3-lora", _tiny_lora


#: the tiny models whose ops the pooled per-op figures ("forward", ..., "checkpointed") are
#: averaged over, as before the LoRA'd one was timed
POOLED = ("gpt2", "llama3")
POLICIES = (("full", ""), ("selective", "_selective"))


def step_overhead(
    dev: torch.device, reps: int = 20, rounds: int = 5, warmup: int = 10
) -> dict[str, float]:
    """Host seconds per traced ATen op, per phase, in eager training steps of the POOLED tiny
    models (`gobrrr calibrate`): the per-op figures of `step_overhead_rows`, without the
    two-part checkpoint fit, which is not adopted (docs/lora.md: it puts the built-in
    suite's steps past their bound), so a calibration made by `gobrrr calibrate` charges the
    surcharge per op, as the shipped one does, and does not time the LoRA'd model the fit
    alone needs."""
    out, _ = step_overhead_rows(dev, reps, rounds, warmup, models=POOLED)
    return {k: v for k, v in out.items() if "_fit_" not in k}


def step_overhead_rows(
    dev: torch.device,
    reps: int = 20,
    rounds: int = 5,
    warmup: int = 10,
    models: tuple[str, ...] | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """({key: host seconds}, rows): the tiny models of `_fit_workloads` (those named in
    `models`, None: all) timed in `rounds` alternating rounds of `reps` steps per model after
    `warmup` steps each, the median of all of them, then read by `summarize`.

    On a shared machine the host's speed drifts over seconds to minutes, and a real step sees
    the same drift. Six back-to-back measurements in one process
    (docs/investigations/2026-11-22-host-overhead-measurement-spread.md) found five rounds
    steadier than one in one trial and no better in another:
    spreads of 20% and 32% per forward op against 49% and 30%."""
    timed = [
        _timed_model(make, ckpt, dev, warmup, name)
        for name, make in _fit_workloads()
        if models is None or name in models
        for ckpt in ("none", "full", "selective")
    ]
    for _ in range(rounds):
        for m in timed:
            for _ in range(reps):
                for p, t in _phase_times(m.workload, m.optimizer, dev).items():
                    m.times[p].append(t)
    return summarize(timed)


def summarize(models: list[_Timed]) -> tuple[dict[str, float], list[dict]]:
    """The figures of timed tiny models (`_Timed`, "none" / "full" / "selective" each).

    Per phase (PHASES), over the POOLED models without checkpointing: the summed median
    seconds over the summed ops. "recompute" and "checkpointed": the same models with every
    block checkpointed ("_selective": every block under the selective policy, whose dispatch
    mode sees every op). A recomputed op costs its backward's time less what its backward ops
    cost at the backward rate, over its recomputed ops; a forward op inside a checkpointed
    block costs its forward's time less what the other forward ops cost at the forward rate,
    over those ops. That carries the checkpoint machinery (saved-tensor hooks on every saved
    tensor, re-entering the block's Python) as a cost per op.

    "checkpointed_fit_per_op" and "checkpointed_fit_per_saved" (and "checkpointed_selective_
    fit_..."): the same forward surcharge as a + b x saved per checkpointed op, s and
    s/tensor, fitted over every model's row (`surcharge_rows`, `fit_surcharge`). Returns the
    figures and the rows."""
    plain = [m for m in models if m.checkpoint == "none" and m.name in POOLED]
    out = {
        p: sum(statistics.median(m.times[p]) for m in plain) / n
        for p in PHASES
        if (n := sum(m.counts[p] for m in plain))
    }
    for policy, suffix in POLICIES:
        ckpt = [m for m in models if m.checkpoint == policy and m.name in POOLED]
        for key, phase, others in (
            ("recompute", "backward", "backward"),
            ("checkpointed", "forward", "outside"),
        ):
            if phase in out and (n := sum(m.counts[key] for m in ckpt)):
                extra = sum(
                    statistics.median(m.times[phase]) - m.counts[others] * out[phase] for m in ckpt
                )
                out[key + suffix] = max(extra / n, out.get("forward", 0.0))
    rows = surcharge_rows(models)
    for policy, suffix in POLICIES:
        fit = fit_surcharge([r for r in rows if r["policy"] == policy])
        if fit is not None:
            out[f"checkpointed{suffix}_fit_per_op"] = fit[0]
            out[f"checkpointed{suffix}_fit_per_saved"] = fit[1]
    return out, rows


def surcharge_rows(models: list[_Timed]) -> list[dict]:
    """One row per tiny model and checkpoint policy: "extra_s", the seconds its checkpointed
    forward took beyond its forward ops at its own plain forward's seconds per op (the same
    model timed without checkpointing), and the ops inside checkpointed blocks that paid it
    ("checkpointed") with the tensors they saved for backward ("saved")."""
    plain = {m.name: m for m in models if m.checkpoint == "none"}
    rows = []
    for m in models:
        base = plain.get(m.name)
        if m.checkpoint == "none" or base is None or not m.counts["checkpointed"]:
            continue
        rate = statistics.median(base.times["forward"]) / base.counts["forward"]
        forward = statistics.median(m.times["forward"])
        rows.append(
            {
                "model": m.name,
                "policy": m.checkpoint,
                "extra_s": forward - m.counts["forward"] * rate,
                "checkpointed": m.counts["checkpointed"],
                "saved": m.counts["saved"],
                "forward_s": forward,
                "plain_forward_s": rate * base.counts["forward"],
            }
        )
    return rows


def fit_surcharge(rows: list[dict]) -> tuple[float, float] | None:
    """(a, b): the least-squares fit of extra_s = a x checkpointed + b x saved over `rows`
    (`surcharge_rows`), with a >= 0 s an op and b >= 0 s a saved tensor (non-negative least
    squares): where the free fit gives one of them below 0, that one is 0 and the other is
    fitted alone; where both alone would be below 0, both are 0. Rows whose ops save tensors
    at one density alone cannot tell a from b: then the surcharge is all per op (b = 0), as
    it was charged before. None without rows."""
    if not rows:
        return None
    n = [float(r["checkpointed"]) for r in rows]
    s = [float(r["saved"]) for r in rows]
    y = [float(r["extra_s"]) for r in rows]
    nn_, ns, ss = _dot(n, n), _dot(n, s), _dot(s, s)
    ny, sy = _dot(n, y), _dot(s, y)
    det = nn_ * ss - ns * ns
    if det <= 1e-9 * nn_ * ss:  # one density (or nothing saved): a and b cannot be told apart
        return max(ny / nn_, 0.0), 0.0
    a, b = (ss * ny - ns * sy) / det, (nn_ * sy - ns * ny) / det
    if a >= 0 and b >= 0:
        return a, b
    # the least squares under a, b >= 0 lies on an edge: one of them 0, the other fitted alone
    fits = ((max(ny / nn_, 0.0), 0.0), (0.0, max(sy / ss, 0.0)))
    return min(fits, key=lambda f: _residual(f, n, s, y))


def _dot(u: list[float], v: list[float]) -> float:
    return sum(a * b for a, b in zip(u, v, strict=True))


def _residual(fit: tuple[float, float], n: list[float], s: list[float], y: list[float]) -> float:
    """Sum of squared misses of extra = fit[0] x ops + fit[1] x saved over the rows."""
    return sum((fit[0] * a + fit[1] * b - c) ** 2 for a, b, c in zip(n, s, y, strict=True))


def checkpointed_counts(graph) -> dict[str, int]:
    """The forward ops of `graph` inside checkpointed blocks ("checkpointed") and the tensors
    they saved for backward ("saved"), as `surcharge_rows` counts them."""
    under = checkpointed_modules(graph)
    ops = [n for n in graph.nodes if n.phase == "forward" and n.module in under]
    return {"checkpointed": len(ops), "saved": sum(n.saved or 0 for n in ops)}


class _Timed(NamedTuple):
    """A tiny model ready to time: its ops per phase (and inside / outside checkpointed blocks,
    and the tensors those inside saved: `tiny_counts`) and the seconds of each timed step, per
    phase."""

    workload: object
    optimizer: torch.optim.Optimizer | None
    checkpoint: str
    counts: dict[str, int]
    times: dict[str, list[float]]
    name: str = ""


def _timed_model(make, checkpoint: str, dev: torch.device, warmup: int, name: str) -> _Timed:
    """A tiny model with `checkpoint`, on the device, warmed up."""
    policies = _policies(make, checkpoint)
    counts = tiny_counts(make, checkpoint)
    wl, opt, _ = prepare(
        make(), dev.type, "fp32", checkpoint="none" if checkpoint == "selective" else checkpoint
    )
    if checkpoint == "selective":
        apply_checkpointing(wl.model, policies)
    for _ in range(warmup):
        _phase_times(wl, opt, dev)
    return _Timed(wl, opt, checkpoint, counts, {p: [] for p in PHASES}, name)


def _policies(make, checkpoint: str) -> str | dict[str, str]:
    if checkpoint != "selective":
        return checkpoint
    return dict.fromkeys(block_names(make().model), "selective")


def tiny_counts(make, checkpoint: str) -> dict[str, int]:
    """The ops of tiny model `make` per phase under `checkpoint` ("none", "full",
    "selective"), those of its forward inside checkpointed blocks and outside them, and the
    tensors those inside saved for backward, as traced (they do not depend on the device)."""
    graph = capture(make, precision="fp32", checkpoint=_policies(make, checkpoint))
    counts = {p: sum(1 for n in graph.nodes if n.phase == p) for p in (*PHASES, "recompute")}
    counts.update(checkpointed_counts(graph))
    counts["outside"] = counts["forward"] - counts["checkpointed"]
    return counts


def _phase_times(wl, opt, dev) -> dict[str, float]:
    out = {}
    sync(dev)
    t0 = time.perf_counter()
    loss = wl.compute_loss(wl.batch)
    sync(dev)
    t1 = time.perf_counter()
    loss.backward()
    sync(dev)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(dev)
    t3 = time.perf_counter()
    out["forward"], out["backward"], out["optimizer"] = t1 - t0, t2 - t1, t3 - t2
    return out


def _host_cases(dev: torch.device):
    """(op name, fn) on tiny inputs: the GPU work is negligible, so a loop of calls measures
    what the host spends per call (dispatch, cuDNN's plan lookup, the launches)."""
    aten = torch.ops.aten
    x = torch.randn(2, 8, 8, 8, device=dev)
    w = torch.randn(8, 8, 3, 3, device=dev)
    y = aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    gy = torch.randn_like(y)
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd, gd = x.to(dtype), w.to(dtype), gy.to(dtype)
        key = "bf16" if dtype == torch.bfloat16 else "fp32"
        yield (
            f"convolution:{key}",
            lambda xd=xd, wd=wd: aten.convolution(
                xd, wd, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1
            ),
        )
        yield (
            f"convolution_backward:{key}",
            lambda xd=xd, wd=wd, gd=gd: aten.convolution_backward(
                gd, xd, wd, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False]
            ),
        )
        xb = torch.randn(2, 8, 8, 8, device=dev, dtype=dtype)
        bw, bb = torch.ones(8, device=dev), torch.zeros(8, device=dev)
        rm, rv = torch.zeros(8, device=dev), torch.ones(8, device=dev)
        yield (
            f"native_batch_norm:{key}",
            lambda xb=xb, bw=bw, bb=bb, rm=rm, rv=rv: F.batch_norm(
                xb, rm, rv, bw, bb, True, 0.1, 1e-5
            ),
        )
    a = torch.randn(8, device=dev)
    yield "add", lambda: aten.add(a, a)


#: optimizers whose whole step's host cost is measured, by gobrrr.training.optimizers.optimizer_key
OPTIMIZERS = (
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True),
)
OPTIMIZER_PARAMS = (16, 64, 256, 1024)  # parameter tensors per step
#: parameter elements: served by the caching allocator's small pool, and by its large one
OPTIMIZER_SIZES = (64, 2**20)


def optimizer_host(dev: torch.device, reps: int = 15) -> dict[str, dict[str, list[list[float]]]]:
    """{key: {"<elements>": [[parameter tensors, host seconds], ...]}}: the host's time to
    issue `optimizer.step()` then `zero_grad(set_to_none=True)`, as a training step runs them,
    over OPTIMIZER_PARAMS fp32 parameters of each of OPTIMIZER_SIZES elements (the GPU
    synchronised outside the timed call); the median over `reps` steps after 3 (the first
    makes the state). A foreach optimizer costs the host per parameter tensor: its Python
    (the state's lists, the bias corrections read from host step counters) and the
    allocations of its list ops' outputs, dearer for large-pool tensors (measured on an H100
    in benchmarks/results/optimizer_host_profile_h100.json: AdamW's step ~25 us of Python
    per tensor, 7 us per large output allocated)."""
    out: dict[str, dict[str, list[list[float]]]] = {}
    for make in OPTIMIZERS:
        key = optimizer_key(make([torch.zeros(1, device=dev, requires_grad=True)]))
        out[key] = {}
        for size in OPTIMIZER_SIZES:
            points = []
            for n in OPTIMIZER_PARAMS:
                params = [torch.zeros(size, device=dev, requires_grad=True) for _ in range(n)]
                grads = [torch.ones(size, device=dev) for _ in range(n)]
                opt = make(params)
                times = []
                for r in range(reps + 3):
                    for p, g in zip(params, grads, strict=True):
                        p.grad = g
                    sync(dev)
                    t0 = time.perf_counter()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    t = time.perf_counter() - t0
                    sync(dev)
                    if r >= 3:
                        times.append(t)
                points.append([float(n), statistics.median(times)])
                del opt, params, grads
                torch.cuda.empty_cache()
            out[key][str(size)] = points
    return out


def op_host_costs(dev: torch.device, calls: int = 400) -> dict[str, float]:
    """Host seconds per call that ops heavier on the host than a plain kernel launch add over
    an elementwise add (keys "op:dtype"): cuDNN convolutions (forward, backward), batch
    norm, and the fused attention backends (`attention_host_costs`). The step's per-op
    overhead (`op_overhead`) already covers an ordinary op; this is the extra. Timed as
    back-to-back calls on tiny tensors, so the host, not the GPU, is what the loop waits on."""
    costs = {name: per_call(fn, dev, calls, rounds=5, warmup=20) for name, fn in _host_cases(dev)}
    base = costs.pop("add")
    return {k: max(v - base, 0.0) for k, v in costs.items()} | attention_host_costs(
        dev, calls, base
    )


#: SDPA's fused backends, as the ATen ops a training step runs for them
ATTENTION_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def attention_host_costs(
    dev: torch.device, calls: int = 400, base: float | None = None
) -> dict[str, float]:
    """Host seconds per call of SDPA's fused attention ops beyond an elementwise add, forward
    and backward, per backend (keys "op:bf16", the ATen op each backend's forward and
    backward dispatch to): cuDNN's builds its graph's variant pack on every call, flash and
    efficient attention check their inputs and pick a kernel. Each op is recorded once as a
    training step calls it (through autograd, for the backward), then called again with the
    same arguments, back to back, on tiny tensors. A backend this GPU or PyTorch does not
    run is left out. `base`: an add's seconds per call, measured here when not given."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func.__name__:
                self.calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    q, k, v = (
        torch.randn(1, 2, 64, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    if base is None:
        a = torch.randn(8, device=dev)
        base = per_call(lambda: torch.ops.aten.add(a, a), dev, calls, rounds=5, warmup=20)
    out: dict[str, float] = {}
    for name in ATTENTION_BACKENDS:
        try:
            with sdpa_kernel(getattr(SDPBackend, name)), Record() as rec:
                y = F.scaled_dot_product_attention(q, k, v)
                y.backward(torch.ones_like(y))
        except (RuntimeError, AttributeError):
            continue
        for func, args, kwargs in rec.calls:
            op = func.__name__.split(".")[0]
            t = per_call(
                lambda f=func, a=args, kw=kwargs: f(*a, **kw), dev, calls, rounds=5, warmup=20
            )
            out[f"{op}:bf16"] = max(t - base, 0.0)
    return out


def per_call(fn, dev: torch.device, calls: int, rounds: int, warmup: int) -> float:
    """Least over `rounds` of the mean wall seconds per call of `calls` back-to-back calls of
    fn(), after `warmup` calls; the device is synchronised outside the timed loops."""
    for _ in range(warmup):
        fn()
    sync(dev)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
        sync(dev)
    return best
