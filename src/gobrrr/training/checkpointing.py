"""Transforms of a user's model that the estimate, the profiler and the planner share.

    apply_checkpointing(model)                                  # every repeated block, "full"
    apply_checkpointing(model, {"h.0": "full", "h.1": "selective"})
    remove_checkpointing(model)                                 # back to the plain forward

"full" wraps a block's forward in torch.utils.checkpoint (non-reentrant): only its inputs are
kept, and backward runs its forward again. "selective" does the same under a selective-
checkpoint policy: the outputs of the ops in SELECTIVE_SAVE (matmuls, convolutions,
attention) are kept from the forward, every other op is run again. The graph pass
`gobrrr.passes.checkpoint` predicts the same step from a graph traced without either.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gobrrr.errors import GobrrrError

POLICIES = ("full", "selective")

#: The ops whose outputs a "selective" checkpoint keeps (CheckpointPolicy.MUST_SAVE), as the
#: graph names them; every other op in the block is recomputed (PREFER_RECOMPUTE). Ops this
#: torch does not have are simply never met.
SELECTIVE_SAVE = frozenset(
    {
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten.convolution.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "gobrrr.attention_fwd.default",
    }
)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a transformer (or ResNet) repeats: the children of the outermost
    nn.ModuleList/nn.Sequential whose children are two or more modules of one class."""
    found: list[nn.Module] = []
    claimed: set[int] = set()
    for _name, mod in model.named_modules():
        if id(mod) in claimed or not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(mod.children())
        if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and _has_params(kids[0]):
            found.extend(kids)
            claimed.update(id(m) for m in mod.modules())
    return found


def block_names(model: nn.Module) -> list[str]:
    """Qualified names (as `model.named_modules()` gives them) of `repeated_blocks(model)`."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(b)] for b in repeated_blocks(model)]


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _save_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing: keep the outputs of SELECTIVE_SAVE, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if str(op) in SELECTIVE_SAVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_policy)


def _wrap(block: nn.Module, policy: str) -> None:
    """Replace `block.forward` by a checkpointed call of its own forward under `policy`."""
    inner = block.__dict__.get("_gobrrr_inner", block.forward)
    extra = {"context_fn": _selective_contexts} if policy == "selective" else {}

    cache_at = {} if getattr(block, "_can_checkpoint_with_cache", False) else _cache_params(inner)

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        if cache_at:
            args, kwargs = _without_kv_cache(cache_at, args, kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    if "_gobrrr_inner" not in block.__dict__:
        block._gobrrr_inner = inner
        block._gobrrr_own_forward = "forward" in block.__dict__  # the user set one himself
    block.forward = forward
    block._gobrrr_checkpointed = policy


_CACHE_ARGS = {"use_cache": False, "past_key_values": None, "layer_past": None}


def _cache_params(fn) -> dict[str, int]:
    """{name: position} of the KV-cache parameters (_CACHE_ARGS) that `fn` takes."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return {}
    return {p.name: i for i, p in enumerate(params) if p.name in _CACHE_ARGS}


def _without_kv_cache(cache_at: dict[str, int], args: tuple, kwargs: dict):
    """A checkpointed layer must not write a KV cache: its recomputation would write it again
    (and a selective checkpoint would meet other ops than it cached). As Hugging Face's own
    gradient checkpointing does (GradientCheckpointingLayer), the layer runs without one."""
    args = list(args)
    for name, i in cache_at.items():
        if i < len(args):
            args[i] = _CACHE_ARGS[name] if args[i] else args[i]
        elif kwargs.get(name):
            kwargs = {**kwargs, name: _CACHE_ARGS[name]}
    return tuple(args), kwargs


def _resolve(model: nn.Module, policies: Mapping[str, str] | None) -> list[tuple[nn.Module, str]]:
    if policies is None:
        return [(b, "full") for b in repeated_blocks(model)]
    out = []
    for name, policy in policies.items():
        if policy not in POLICIES:
            raise GobrrrError(
                f"unknown checkpoint policy {policy!r} for block {name!r}: "
                f"choose {', '.join(POLICIES)}"
            )
        try:
            out.append((model.get_submodule(name), policy))
        except AttributeError:
            known = ", ".join(block_names(model)[:4]) or "none found"
            raise GobrrrError(
                f"checkpoint: the model has no module {name!r}; name blocks as "
                f"model.named_modules() does (repeated blocks: {known}, ...)"
            ) from None
    return out


def apply_checkpointing(
    model: nn.Module, policies: Mapping[str, str] | None = None
) -> list[nn.Module]:
    """Checkpoint blocks of `model` in place. `policies`: block name (as
    `model.named_modules()` names it) -> "full" | "selective"; None = every repeated block
    "full". Applying the same policies again changes nothing; a block given another policy is
    re-wrapped around its original forward. Each wrapped block carries
    `_gobrrr_checkpointed` = its policy. Returns the blocks wrapped."""
    blocks = []
    for block, policy in _resolve(model, policies):
        if getattr(block, "_gobrrr_checkpointed", None) != policy:
            _wrap(block, policy)
        blocks.append(block)
    return blocks


def remove_checkpointing(model: nn.Module) -> int:
    """Undo `apply_checkpointing` on every module of `model`; returns how many were undone."""
    undone = 0
    for m in model.modules():
        if "_gobrrr_inner" not in m.__dict__:
            continue
        if m.__dict__.pop("_gobrrr_own_forward"):
            m.forward = m.__dict__["_gobrrr_inner"]
        else:
            del m.forward
        del m._gobrrr_inner, m._gobrrr_checkpointed
        undone += 1
    return undone


def checkpointed(model: nn.Module) -> dict[str, str]:
    """{block name: policy} of the blocks `apply_checkpointing` wrapped in `model`."""
    return {
        n: m._gobrrr_checkpointed for n, m in model.named_modules() if "_gobrrr_inner" in m.__dict__
    }


def checkpoint_meta(policies: Mapping[str, str], blocks: list[str]) -> str | dict[str, str]:
    """How a graph's meta.checkpoint names a step's checkpointing: "none", "full" (every
    repeated block, "full"), or the {block: policy} mapping itself."""
    if not policies:
        return "none"
    if blocks and dict(policies) == dict.fromkeys(blocks, "full"):
        return "full"
    return dict(policies)
