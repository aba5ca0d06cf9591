"""Built-in workloads by name, and user workloads loaded from `path/to/file.py:function`."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

import torch

from gobrrr.errors import GobrrrError
from gobrrr.formulas import transformer_params
from gobrrr.models.convnet import ConvNet, ConvNetConfig, convnet_params
from gobrrr.models.gpt2 import GPT2, GPT2_CONFIGS
from gobrrr.models.llama import LLAMA_CONFIGS, Llama
from gobrrr.models.mlp import DeepMLP, MLPConfig, mlp_params
from gobrrr.workload import Workload

# name -> (family, config); defaults per family: (batch, seq)
_MODELS: dict[str, tuple[str, Any]] = {
    **{n: ("gpt2", c) for n, c in GPT2_CONFIGS.items()},
    **{n: ("llama", c) for n, c in LLAMA_CONFIGS.items()},
    "mlp": ("mlp", MLPConfig()),
    "convnet": ("convnet", ConvNetConfig()),
}
_DEFAULTS = {"gpt2": (8, 1024), "llama": (1, 2048), "mlp": (1024, None), "convnet": (32, None)}


def model_names() -> list[str]:
    """Names accepted by `get_workload`, in listing order."""
    return list(_MODELS)


def _lookup(name: str, overrides: dict[str, Any]) -> tuple[str, Any]:
    if name not in _MODELS:
        raise GobrrrError(f"unknown model {name!r}: choose one of {', '.join(_MODELS)}")
    family, cfg = _MODELS[name]
    if not overrides:
        return family, cfg
    fields = {f.name for f in dataclasses.fields(cfg)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise GobrrrError(
            f"{name} has no setting {', '.join(bad)}: "
            f"valid settings are {', '.join(sorted(fields))}"
        )
    return family, dataclasses.replace(cfg, **overrides)


def _transformer_info(family: str, cfg: Any) -> dict[str, Any]:
    if family == "gpt2":
        return dict(
            layers=cfg.n_layer,
            hidden=cfg.n_embd,
            heads=cfg.n_head,
            kv_heads=cfg.n_head,
            vocab=cfg.vocab_size,
            ffn=4 * cfg.n_embd,
            tied=True,
            family="gpt2",
        )
    return dict(
        layers=cfg.n_layer,
        hidden=cfg.dim,
        heads=cfg.n_head,
        kv_heads=cfg.n_kv_head,
        vocab=cfg.vocab_size,
        ffn=cfg.ffn_dim,
        tied=cfg.tied,
        family="llama",
    )


def _max_seq(family: str, cfg: Any) -> int | None:
    return {"gpt2": lambda: cfg.block_size, "llama": lambda: cfg.max_seq_len}.get(
        family, lambda: None
    )()


def _check_sizes(name: str, batch: int, seq: int | None, max_seq: int | None) -> None:
    if batch <= 0:
        raise GobrrrError(f"batch size {batch} for {name}: give a positive number (e.g. 8)")
    if seq is None:
        return
    if seq <= 0:
        raise GobrrrError(f"sequence length {seq} for {name}: give a positive number (e.g. 1024)")
    if max_seq is not None and seq > max_seq:
        raise GobrrrError(
            f"sequence length {seq} exceeds {name}'s maximum of {max_seq}: use --seq {max_seq} "
            "or less"
        )


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4)


def get_workload(
    name: str, batch_size: int | None = None, seq_len: int | None = None, **overrides: Any
) -> Workload:
    """A built-in model with a random batch and AdamW(lr=3e-4), ready for one training step.

    The model is built where torch builds tensors now (default device, `meta`, FakeTensorMode)
    and is not moved. `overrides` replace fields of the model's config (e.g. n_layer=2).
    Defaults: gpt2* batch 8, seq 1024; llama3* batch 1, seq 2048; mlp batch 1024; convnet 32.
    """
    family, cfg = _lookup(name, overrides)
    default_batch, default_seq = _DEFAULTS[family]
    batch = default_batch if batch_size is None else batch_size
    note = None
    if family in ("mlp", "convnet"):
        if seq_len is not None:
            note = f"{name} is not a sequence model: seq_len={seq_len} ignored"
        seq_len = None
    else:
        seq_len = default_seq if seq_len is None else seq_len
    max_seq = _max_seq(family, cfg)
    _check_sizes(name, batch, seq_len, max_seq)
    build = {"gpt2": _build_lm, "llama": _build_lm, "mlp": _build_mlp, "convnet": _build_convnet}
    wl = build[family](name, family, cfg, batch, seq_len)
    wl.max_seq_len = max_seq
    if note:
        wl.info["note"] = note
    return wl


def _build_lm(name: str, family: str, cfg: Any, batch: int, seq: int) -> Workload:
    model = GPT2(cfg) if family == "gpt2" else Llama(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))  # (B, T)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq))
    return Workload(
        model=model,
        batch=(idx, targets),
        optimizer=_adamw,
        tokens=batch * seq,
        name=name,
        seq_len=seq,
        info=_transformer_info(family, cfg),
    )


def _build_mlp(name: str, family: str, cfg: MLPConfig, batch: int, seq: None) -> Workload:
    x = torch.randn(batch, cfg.width)  # (B, width)
    target = torch.randn(batch, cfg.width)
    info = dict(layers=cfg.layers, hidden=cfg.width, family="mlp")
    return Workload(
        model=DeepMLP(cfg), batch=(x, target), optimizer=_adamw, tokens=batch, name=name, info=info
    )


def _build_convnet(name: str, family: str, cfg: ConvNetConfig, batch: int, seq: None) -> Workload:
    images = torch.randn(batch, 3, cfg.image_size, cfg.image_size)  # (B, 3, H, W)
    labels = torch.randint(0, cfg.num_classes, (batch,))
    info = dict(
        width=cfg.width, classes=cfg.num_classes, image_size=cfg.image_size, family="convnet"
    )
    return Workload(
        model=ConvNet(cfg),
        batch=(images, labels),
        optimizer=_adamw,
        tokens=batch,
        name=name,
        info=info,
    )


def describe(name: str) -> dict[str, Any]:
    """Family, parameter count (closed form, scalars) and shape facts of a built-in model.

    For transformers `params_nonembed` drops the input embeddings (token, position) but keeps
    the output head, tied or not: the parameters behind the 6·N FLOPs per token.
    """
    family, cfg = _lookup(name, {})
    if family == "mlp":
        return dict(
            name=name,
            family=family,
            params=mlp_params(cfg.layers, cfg.width),
            layers=cfg.layers,
            hidden=cfg.width,
        )
    if family == "convnet":
        params = convnet_params(cfg.width, cfg.num_classes, cfg.blocks_per_stage)
        return dict(name=name, family=family, params=params, width=cfg.width)
    info = _transformer_info(family, cfg)
    positions = cfg.block_size if family == "gpt2" else 0
    params = transformer_params(
        info["layers"],
        info["hidden"],
        info["vocab"],
        ffn=info["ffn"],
        kv_heads=info["kv_heads"],
        heads=info["heads"],
        tied=info["tied"],
        gated=family == "llama",
        bias=family == "gpt2",
        positions=positions,
    )
    embed = info["vocab"] * info["hidden"] + positions * info["hidden"]
    head = info["vocab"] * info["hidden"] if info["tied"] else 0
    return dict(
        name=name,
        params=params,
        params_nonembed=params - embed + head,
        max_seq_len=_max_seq(family, cfg),
        **info,
    )


def load_workload(spec: str, batch_size: int | None = None, seq_len: int | None = None) -> Workload:
    """Call the function `fn` of `path/to/file.py:fn` and return the Workload it builds.

    `batch_size=` and `seq_len=` are passed only when given and when the function takes them.
    Every failure (no such file or function, the function raises, returns something else)
    becomes a one-line GobrrrError naming the spec.
    """
    path, sep, fn_name = spec.rpartition(":")
    if not sep or not path or not fn_name:
        raise GobrrrError(f"workload {spec!r}: write it as path/to/file.py:function")
    fn = _import_function(spec, Path(path), fn_name)
    kwargs = _accepted_kwargs(fn, batch_size=batch_size, seq_len=seq_len)
    try:
        wl = fn(**kwargs)
    except Exception as e:  # user code: report it in one line
        raise GobrrrError(f"workload {spec} raised {type(e).__name__}: {e}") from e
    if not isinstance(wl, Workload):
        raise GobrrrError(
            f"workload {spec} returned {type(wl).__name__}, not a gobrrr.Workload: "
            "return Workload(model=..., batch=...)"
        )
    return wl


def _import_function(spec: str, path: Path, fn_name: str):
    if not path.is_file():
        raise GobrrrError(f"workload {spec}: file {path} not found")
    module_spec = importlib.util.spec_from_file_location(f"gobrrr_user_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise GobrrrError(f"workload {spec}: cannot import {path} (is it a .py file?)")
    module = importlib.util.module_from_spec(module_spec)
    # as `python file.py` would: modules beside the file import, and the module is registered
    # (dataclasses and pickling look their module up in sys.modules)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[module_spec.name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_spec.name, None)
        raise GobrrrError(
            f"workload {spec}: importing {path} raised {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = [n for n, v in vars(module).items() if inspect.isfunction(v) and n[0] != "_"]
        raise GobrrrError(
            f"workload {spec}: {path} has no function {fn_name!r} (functions: {', '.join(names)})"
        )
    return fn


def _accepted_kwargs(fn, **given: Any) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in given.items() if v is not None and (var_kw or k in params)}
