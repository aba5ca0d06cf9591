"""torchao's 8-bit Adam(W) as the planner traces it: the same state tensors, made in the same
order, and one op per parameter update (`gobrrr::adam8bit_update`) in place of torchao's
torch.compile'd `single_param_adam`, which a trace on fake tensors cannot run.

torchao.optim.AdamW8bit (0.18) keeps, per parameter, on the parameter's device:
  step: a 0-d fp32 tensor on the host;
  exp_avg, exp_avg_sq: for a parameter of >= 4096 elements that 256 divides, 8-bit codes
    (uint8, the parameter's shape), one fp32 scale per block of 256 elements and a 256-entry
    fp32 code book (signed for exp_avg, unsigned for exp_avg_sq), made in that order; else
    zeros like the parameter (its dtype).
Here the codes, scales and code books are plain tensors in the state under "exp_avg",
"exp_avg_scale", "exp_avg_qmap" (and the same for exp_avg_sq): the trace registers each as an
optimizer state. The update's arithmetic is torchao's (fp32, the moments re-quantised with
its absmax scaling and code search).

What the update allocates on a GPU depends on the parameter's layout. Inductor compiles
`single_param_adam` for CUDA per parameter shape; for rows of one quantisation block
((n, 256)) it is one Triton kernel whose wrapper allocates no buffer (measured on an H100,
torch 2.11, triton 3.6: the allocated peak of a step of such updates stayed at the bytes
allocated before it for 1024 to 64M elements); for any other row width it splits the update
and keeps the new moments in fp32 between the kernels: two buffers of the parameter's size
and two of its block count, freed before the update returns (benchmarks/results/
calibration_sections_h100_run18.json and optim8_transient_h100.json; a GPT-2 step's
allocated peak is the (50257, 768) embedding's update). The trace's op allocates nothing;
memory.step_scratch adds those blocks (cost._ops_optim.adam8bit_scratch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gobrrr.cost._ops_optim import BLOCK, QMAP, quantized
from gobrrr.errors import GobrrrError
from gobrrr.training.optimizers import adam_hyper, states_optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> list[float]:
    """The 256 values an 8-bit code stands for, sorted: bitsandbytes' dynamic map without zero
    padding, as torchao.optim.quant_utils.create_dynamic_map builds it."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = int(
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        )
        data += _means(items, i, max_exponent_bits, signed)
    if extra > 0:
        data += _means(extra + 1, max_exponent_bits - 1, max_exponent_bits, signed)
    data += [0, 1.0]
    assert len(data) == 2**total_bits
    return sorted(data)


def _means(items: int, i: int, max_exponent_bits: int, signed: bool) -> list[float]:
    bounds = torch.linspace(0.1, 1, items)
    means = (bounds[:-1] + bounds[1:]) / 2.0
    scale = 10 ** (-(max_exponent_bits - 1) + i)
    out = (scale * means).tolist()
    return out + ((-scale * means).tolist() if signed else [])


_QMAPS: dict[bool, list[float]] = {}


def qmap_values(signed: bool) -> list[float]:
    if signed not in _QMAPS:
        _QMAPS[signed] = dynamic_map(signed)
    return _QMAPS[signed]


def _scaled(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """x / absmax of its block, and the absmax (clipped at 1e-12), one per block."""
    blocks = x.view(-1, block)
    scale = blocks.abs().amax(-1).clip(1e-12)
    return (blocks / scale.view(-1, 1)).view(x.shape), scale


def _quantize(x: Tensor, qmap: Tensor) -> Tensor:
    """The nearest code of each element (x in [-1, 1]): torchao's branchless binary search."""
    codes = torch.where(x >= qmap[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        codes += torch.where(x >= qmap[codes + step], step, 0)
    up = (codes + 1).clip(max=255)
    low, high = qmap[codes], qmap[up]
    codes = torch.where(x - low >= (high - low) * 0.5, up, codes)
    return codes.to(torch.uint8)


def _dequantize(codes: Tensor, qmap: Tensor, scale: Tensor) -> Tensor:
    return (qmap[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)).view(codes.shape)


@torch.library.custom_op(
    "gobrrr::adam8bit_update",
    mutates_args=("param", "step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"),
    schema="(Tensor(a!) param, Tensor grad, Tensor(f!) step, Tensor(b!) exp_avg, "
    "Tensor(c!)? exp_avg_scale, Tensor? exp_avg_qmap, Tensor(d!) exp_avg_sq, "
    "Tensor(e!)? exp_avg_sq_scale, Tensor? exp_avg_sq_qmap, float lr, float beta1, "
    "float beta2, float weight_decay, float eps, bool adamw) -> ()",
)
def adam8bit_update(
    param,
    grad,
    step,
    exp_avg,
    exp_avg_scale,
    exp_avg_qmap,
    exp_avg_sq,
    exp_avg_sq_scale,
    exp_avg_sq_qmap,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    adamw,
):
    """One parameter's Adam(W) update with torchao's arithmetic (`single_param_adam`): the
    step count (a 0-d fp32 host tensor) incremented, fp32 math, decoupled weight decay
    (adamw) or L2, the moments lerped and, where quantised, re-quantised in blocks. (torchao
    increments the step in Python before its compiled call; here it is part of the one op,
    so that the update's host cost is one op's.)"""
    f32 = torch.float32
    step.add_(1)
    lr_t, step_t = torch.tensor(lr, dtype=f32), step.to(f32)
    p32, g32 = param.float(), grad.float()
    if adamw:
        p32 = p32 - lr_t * weight_decay * p32
    else:
        g32 = g32 + weight_decay * p32
    bc1, bc2 = 1 - beta1**step_t, 1 - beta2**step_t
    states = (
        (exp_avg, exp_avg_scale, exp_avg_qmap, g32, beta1),
        (exp_avg_sq, exp_avg_sq_scale, exp_avg_sq_qmap, g32.square(), beta2),
    )
    new = []
    for codes, scale, qmap, target, beta in states:
        old = codes.float() if qmap is None else _dequantize(codes, qmap, scale)
        m = old.lerp(target, 1 - beta)
        if qmap is None:
            codes.copy_(m)
        else:
            x, s = _scaled(m, codes.numel() // scale.numel())
            codes.copy_(_quantize(x, qmap))
            scale.copy_(s)
        new.append(m)
    denom = new[1].sqrt() / bc2.sqrt() + eps
    param.copy_(p32 - lr_t * (new[0] / bc1) / denom)


@adam8bit_update.register_fake
def _(
    param,
    grad,
    step,
    exp_avg,
    exp_avg_scale,
    exp_avg_qmap,
    exp_avg_sq,
    exp_avg_sq_scale,
    exp_avg_sq_qmap,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    adamw,
):
    return None  # in place, nothing allocated (see the module's docstring)


def state_bytes(numel: int, itemsize: int) -> int:
    """Bytes of the two moments torchao's 8-bit Adam keeps for a parameter of `numel`
    elements of `itemsize` bytes (the step, a host tensor, aside): codes, scales and code
    books where quantised, else two tensors like the parameter."""
    if quantized(numel):
        return 2 * (numel + 4 * (numel // BLOCK) + 4 * QMAP)
    return 2 * numel * itemsize


class Adam8bitTrace(torch.optim.Optimizer):
    """torchao's Adam8bit / AdamW8bit (decoupled) with plain-tensor states and one
    `gobrrr::adam8bit_update` per parameter; block size 256, no amsgrad, no stochastic
    rounding (what `gobrrr.training.optimizers.states_optimizer(opt, "8bit")` builds)."""

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
        if lr < 0 or eps < 0 or not all(0 <= b < 1 for b in betas):
            raise GobrrrError(
                f"Adam8bit(lr={lr}, betas={betas}, eps={eps}): give lr, eps >= 0 "
                "and betas in [0, 1)"
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decoupled = decoupled

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["step"] = torch.tensor(0.0)  # on the host, as torchao keeps it
        for name in MOMENTS:
            if quantized(p.numel()):
                state[name] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
                state[f"{name}_scale"] = torch.zeros(p.numel() // BLOCK, device=p.device)
                state[f"{name}_qmap"] = torch.tensor(
                    qmap_values(name == "exp_avg"), dtype=torch.float32, device=p.device
                )
            else:
                state[name] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                self._update(p, state, group)
        return loss

    def _update(self, p: Tensor, state: dict, group: dict) -> None:
        b1, b2 = group["betas"]
        adam8bit_update(
            p,
            p.grad,
            state["step"],
            state["exp_avg"],
            state.get("exp_avg_scale"),
            state.get("exp_avg_qmap"),
            state["exp_avg_sq"],
            state.get("exp_avg_sq_scale"),
            state.get("exp_avg_sq_qmap"),
            float(group["lr"]),
            float(b1),
            float(b2),
            float(group["weight_decay"]),
            float(group["eps"]),
            self.decoupled,
        )


def traced_states_optimizer(opt: torch.optim.Optimizer, states: str) -> torch.optim.Optimizer:
    """The optimizer a trace runs for `states`: Adam8bitTrace in place of torchao's 8-bit
    Adam(W) (same groups and hyper-parameters), else what `gobrrr.apply` runs."""
    if states != "8bit":
        return states_optimizer(opt, states)
    decoupled, groups = adam_hyper(opt)
    return Adam8bitTrace(groups, decoupled=decoupled)


__all__ = [
    "Adam8bitTrace",
    "adam8bit_update",
    "dynamic_map",
    "state_bytes",
    "traced_states_optimizer",
]
