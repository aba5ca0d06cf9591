"""The compiled steps benchmarks/zoo/bench_compiled.py measures on a GPU (zoo cases and gobrrr
built-ins under torch.compile, and eager twins of the built-ins), which
tests/test_compiled_measured.py predicts again against tests/fixtures/compiled_h100_*.json.
"""

from __future__ import annotations

from functools import partial

from gobrrr.errors import GobrrrError
from gobrrr.models.registry import get_workload
from zoo.cases import ZooCase, get_case


def builtin(batch: int, seq: int | None, *, name: str, **overrides):
    """gobrrr's built-in workload `name` (config fields overridden), as a zoo builder."""
    return get_workload(name, batch, seq, **overrides)


def _compiled(case: ZooCase, name: str | None = None) -> ZooCase:
    return ZooCase(
        name or f"{case.name}-compiled",
        case.family,
        case.library,
        case.precision,
        case.batch,
        case.seq,
        True,
        (*case.recipe, "compiled"),
        case.build,
    )


def _eager(case: ZooCase) -> ZooCase:
    return ZooCase(
        case.name.removesuffix("-compiled"),
        case.family,
        case.library,
        case.precision,
        case.batch,
        case.seq,
        False,
        tuple(r for r in case.recipe if r != "compiled"),
        case.build,
    )


_G = "gobrrr"
MLP = ZooCase(
    "mlp-compiled",
    "mlp",
    _G,
    "bf16-mixed",
    1024,
    None,
    True,
    ("compiled",),
    partial(builtin, name="mlp"),
)
GPT2 = ZooCase(
    "gpt2-compiled",
    "gpt2",
    _G,
    "bf16-mixed",
    8,
    1024,
    True,
    ("compiled",),
    partial(builtin, name="gpt2"),
)
GPT2_DROP = ZooCase(
    "gpt2-6l-dropout-compiled",
    "gpt2",
    _G,
    "bf16-mixed",
    8,
    1024,
    True,
    ("dropout-0.1", "layers-cut", "compiled"),
    partial(builtin, name="gpt2", n_layer=6, dropout=0.1),
)
LLAMA = ZooCase(
    "llama3-1b-4l-compiled",
    "llama",
    _G,
    "bf16-mixed",
    2,
    2048,
    True,
    ("layers-cut", "compiled"),
    partial(builtin, name="llama3-1b", n_layer=4),
)
COMPILED = [
    GPT2,
    _compiled(get_case("resnet50-tv-cl")),
    _compiled(get_case("bert-base-mlm")),
    MLP,
    LLAMA,
    GPT2_DROP,
]
# eager twins of the built-ins (the zoo's own eager rows are in tests/fixtures/zoo_h100.json)
CASES = COMPILED + [_eager(c) for c in (MLP, GPT2, LLAMA, GPT2_DROP)]
_BY_NAME = {c.name: c for c in CASES}


def case_named(name: str) -> ZooCase:
    if name not in _BY_NAME:
        raise GobrrrError(f"unknown case {name!r}: choose one of {', '.join(_BY_NAME)}")
    return _BY_NAME[name]
