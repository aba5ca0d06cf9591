"""Optimizer-state storage a plan may choose, built from the user's own Adam/AdamW.

    opt = states_optimizer(user_opt, "bf16")        # AdamW with bf16 moments, fp32 update
    opt = states_optimizer(user_opt, "8bit")        # torchao's AdamW8bit (gobrrr[optim])
    opt = states_optimizer(user_opt, "as-is", offload=True)   # torchao's CPUOffloadOptimizer

Each takes the user's parameter groups and hyper-parameters (lr, betas, eps, weight_decay,
and whether weight decay is decoupled, as in AdamW, or added to the gradient, as in Adam).
"""

from __future__ import annotations

from typing import Any

import torch

from gobrrr.errors import GobrrrError


def optimizer_key(opt: torch.optim.Optimizer) -> str:
    """How the calibration keys an optimizer's host cost (`Calibration.optimizer_host`): its
    class and implementation, and what changes its code path: Adam's and SGD's weight decay
    (added to the gradients out of place, ":wd"), SGD without momentum (":plain"); e.g.
    "AdamW:foreach", "SGD:foreach:wd"."""
    groups = opt.param_groups
    impl = (
        "fused"
        if all(bool(g.get("fused")) for g in groups)
        else "foreach"
        if all(bool(g.get("foreach")) for g in groups)
        else "for-loop"
    )
    name = type(opt).__name__
    key = f"{name}:{impl}"
    if name in ("Adam", "SGD") and any(g.get("weight_decay") for g in groups):
        key += ":wd"
    if name == "SGD" and not any(g.get("momentum") for g in groups):
        key += ":plain"
    return key


#: a parameter whose bytes exceed this is served by the caching allocator's large pool (its
#: per-step host cost in a foreach optimizer is measured apart: `Calibration.optimizer_host`)
LARGE_TENSOR_BYTES = 2**20


#: Hyper-parameters carried from the user's Adam/AdamW to the optimizer that replaces it.
HYPER = ("lr", "betas", "eps", "weight_decay")


class AdamWBF16(torch.optim.Optimizer):
    """Adam(W) whose moments exp_avg and exp_avg_sq are stored in bfloat16 (2 bytes each per
    parameter instead of 4) while the update is computed in fp32: each step widens the
    moments (and bf16 parameters) to fp32, updates them as torch's AdamW does, and rounds
    the moments back to bf16. The fp32 working copies are made a bucket of at most
    `bucket` elements (2**24: <= 320 MiB) at a time, large tensors in slices, so the step
    never holds fp32 moments for the whole model.

    Args:
        params: parameters or parameter groups.
        lr: learning rate. betas: the moments' decay rates. eps: added to sqrt(v̂).
        weight_decay: decoupled (AdamW: p -= lr·wd·p) when `decoupled`, else added to the
            gradient (Adam: g += wd·p).
    """

    state_dtype = torch.bfloat16
    bucket = 2**24

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled: bool = True,
    ):
        if lr < 0 or eps < 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise GobrrrError(
                f"AdamWBF16(lr={lr}, betas={betas}, eps={eps}, weight_decay="
                f"{weight_decay}): give lr, eps, weight_decay >= 0, betas in [0, 1)"
            )
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled),
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            pieces = [
                piece for p in group["params"] if p.grad is not None for piece in self._pieces(p)
            ]
            for bucket in _buckets(pieces, self.bucket):
                _adam_update(group, *zip(*bucket, strict=True))
        return loss

    def _pieces(self, p: torch.Tensor) -> list[tuple]:
        """(param, grad, exp_avg, exp_avg_sq, step) slices of at most `bucket` elements."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)  # on the host, as torch's AdamW keeps it
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        state["step"] += 1
        t, step = (p, p.grad, state["exp_avg"], state["exp_avg_sq"]), float(state["step"])
        if p.numel() <= self.bucket or not all(x.is_contiguous() for x in t):
            return [(*t, step)]
        flat = [x.view(-1) for x in t]
        return [
            (*(x[i : i + self.bucket] for x in flat), step)
            for i in range(0, p.numel(), self.bucket)
        ]


def _buckets(pieces: list[tuple], size: int):
    """Consecutive runs of pieces holding at most `size` elements (one piece at least)."""
    run, n = [], 0
    for piece in pieces:
        if run and n + piece[0].numel() > size:
            yield run
            run, n = [], 0
        run.append(piece)
        n += piece[0].numel()
    if run:
        yield run


def _adam_update(group: dict[str, Any], params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
    """One Adam(W) step of these tensors, foreach over them, in fp32 (torch's AdamW's
    arithmetic); the results written back in the tensors' own dtypes."""
    lr, (b1, b2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    p32 = [p.float() for p in params]  # fp32 parameters: the tensors themselves, no copy
    g32 = [g.float() for g in grads]
    m32 = [m.float() for m in exp_avgs]
    v32 = [v.float() for v in exp_avg_sqs]
    if wd and group["decoupled"]:
        torch._foreach_mul_(p32, 1 - lr * wd)
    elif wd:
        g32 = torch._foreach_add(g32, p32, alpha=wd)
    torch._foreach_lerp_(m32, g32, 1 - b1)  # m = b1·m + (1 - b1)·g
    torch._foreach_mul_(v32, b2)
    torch._foreach_addcmul_(v32, g32, g32, value=1 - b2)  # v = b2·v + (1 - b2)·g²
    denom = torch._foreach_sqrt(v32)
    torch._foreach_div_(denom, [(1 - b2**t) ** 0.5 for t in steps])
    torch._foreach_add_(denom, eps)  # sqrt(v̂) + eps
    torch._foreach_addcdiv_(p32, m32, denom, [-lr / (1 - b1**t) for t in steps])
    for p, pw, m, mw, v, vw in zip(params, p32, exp_avgs, m32, exp_avg_sqs, v32, strict=True):
        if pw is not p:  # parameters in bf16: round the fp32 result back
            p.copy_(pw)
        m.copy_(mw)
        v.copy_(vw)


def adam_hyper(opt: torch.optim.Optimizer) -> tuple[bool, list[dict[str, Any]]]:
    """(decoupled weight decay, the parameter groups with their hyper-parameters) of the
    user's Adam or AdamW. A GobrrrError for any other optimizer, or an Adam option the
    replacement does not have (amsgrad, maximize)."""
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        raise GobrrrError(
            f"optimizer states can only be changed for Adam or AdamW, the "
            f"workload's optimizer is {type(opt).__name__}: keep "
            "optimizer_states='as-is' and offload=False"
        )
    groups = []
    for g in opt.param_groups:
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                raise GobrrrError(
                    f"{type(opt).__name__}({flag}=True) has no bf16/8-bit/offload "
                    f"counterpart here: keep optimizer_states='as-is', offload=False"
                )
        lr = g["lr"]
        groups.append(
            {
                "params": list(g["params"]),
                **{k: g[k] for k in HYPER},
                "lr": float(lr) if isinstance(lr, torch.Tensor) else lr,
            }
        )
    decoupled = isinstance(opt, torch.optim.AdamW) or bool(
        opt.param_groups[0].get("decoupled_weight_decay", False)
    )
    return decoupled, groups


def torchao_optim():
    """torchao.optim, or a GobrrrError saying how to install it."""
    try:
        import torchao.optim
    except ImportError as e:
        raise GobrrrError(
            "8-bit optimizer states and CPU offload use torchao, which is not "
            "installed: pip install 'gobrrr[optim]'"
        ) from e
    return torchao.optim


def states_optimizer(
    opt: torch.optim.Optimizer, states: str = "as-is", offload: bool = False
) -> torch.optim.Optimizer:
    """The optimizer that replaces the user's `opt` (same parameters and hyper-parameters):
    "as-is" keeps `opt` (unless offloaded); "bf16": AdamWBF16; "8bit": torchao's Adam8bit /
    AdamW8bit (moments quantised in blocks of 256; tensors under 4096 elements stay fp32).
    offload: torchao's CPUOffloadOptimizer around that class: the states and a copy of each
    parameter live in pinned host memory and the update runs on the CPU; gradients are
    copied to the host as backward produces them (kept on the GPU too, so accumulation works);
    parameters under 4096 elements stay on the GPU with their own optimizer."""
    if states == "as-is" and not offload:
        return opt
    decoupled, groups = adam_hyper(opt)
    cls, extra = _states_class(states, decoupled)
    if not offload:
        return cls(groups, **extra)
    return _offloaded(cls, extra, groups)


def _states_class(states: str, decoupled: bool) -> tuple[type, dict[str, Any]]:
    if states == "bf16":
        return AdamWBF16, {"decoupled": decoupled}
    if states == "8bit":
        ao = torchao_optim()
        return (ao.AdamW8bit if decoupled else ao.Adam8bit), {}
    if states == "as-is":
        return (torch.optim.AdamW if decoupled else torch.optim.Adam), {}
    raise GobrrrError(f"unknown optimizer_states {states!r}: choose as-is, bf16, 8bit")


def _offloaded(cls: type, extra: dict[str, Any], groups: list[dict[str, Any]]):
    params = [p for g in groups for p in g["params"]]
    if not params or params[0].device.type != "cuda":
        where = params[0].device if params else "nowhere"
        raise GobrrrError(
            f"offload moves optimizer states from a CUDA GPU to the host, but the "
            f"parameters are on {where}: run on a GPU, or set offload=False"
        )
    ao = torchao_optim()
    return ao.CPUOffloadOptimizer(groups, cls, offload_gradients=False, **extra)


__all__ = ["AdamWBF16", "adam_hyper", "states_optimizer", "torchao_optim"]
