"""The micro-batch pass: a graph derived from traces at two micro-batches against a fresh
trace at the same micro-batch, node by node, and through the memory and time predictions."""

from __future__ import annotations

import functools
import sys
from functools import partial

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import predict
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import find_calibration, get_gpu
from gobrrr.memory.replay import step_memory
from gobrrr.models.registry import get_workload
from gobrrr.passes.microbatch import (
    TRACE_AT,
    BatchDependentStructure,
    BatchFamily,
    family,
    first_mismatch,
)
from zoo import cases as zoo
from zoo.common import available

# The zoo's configurations, shrunk (hidden 64, 2 layers, small vocabularies): the same
# builders, recipes and losses, traced in a fraction of a second.
_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def _shrunk(case: partial, **small):
    return partial(case.func, **{**case.keywords, **small})


# name -> (builder(batch, seq) -> Workload, seq, precision, library the builder needs)
CASES = {
    "gpt2": (
        lambda b, s: get_workload("gpt2", b, s, n_layer=2, vocab_size=96),
        32,
        "bf16-mixed",
        None,
    ),
    "gpt2-fp32": (
        lambda b, s: get_workload("gpt2", b, s, n_layer=2, vocab_size=96),
        32,
        "fp32",
        None,
    ),
    "llama3-1b": (
        lambda b, s: get_workload("llama3-1b", b, s, n_layer=2, vocab_size=96),
        32,
        "bf16-mixed",
        None,
    ),
    "mlp": (lambda b, s: get_workload("mlp", b), None, "bf16-mixed", None),
    "convnet": (lambda b, s: get_workload("convnet", b), None, "bf16-mixed", None),
    # HF BERT masked LM, every other row padded (attention mask), dropout on
    "bert-base-mlm-padded": (
        _shrunk(zoo.BERT, pad=True, vocab_size=256, **_SMALL),
        32,
        "bf16-mixed",
        "transformers",
    ),
    # HF Mixtral: top-2 of 4 experts, routing traced under the "balanced" assumption, router
    # auxiliary loss (divides by the token count, a float)
    "mixtral-8x-small": (
        _shrunk(zoo.MIXTRAL, vocab_size=256, num_key_value_heads=2, num_local_experts=4, **_SMALL),
        32,
        "bf16-mixed",
        "transformers",
    ),
    # torchvision ResNet in channels-last with SGD momentum, the zoo's resnet50-tv-cl recipe
    # on the smaller ResNet-18
    "resnet18-tv-cl": (
        partial(zoo.TV, arch="resnet18", channels_last=True, optimizer=zoo.SGD),
        None,
        "bf16-mixed",
        "torchvision",
    ),
}
BUILT_INS = ("gpt2", "gpt2-fp32", "llama3-1b", "mlp", "convnet")
ZOO = ("bert-base-mlm-padded", "mixtral-8x-small", "resnet18-tv-cl")


@pytest.fixture(autouse=True, scope="module")
def _transformers_logging():
    """transformers binds its log handler to the stderr of the moment it first logs (one of
    these tests' capture); unbound afterwards, so later tests' own capture sees its notices."""
    yield
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging._reset_library_root_logger()


def _needs(name: str) -> None:
    library = CASES[name][3]
    if library and not available(library):
        pytest.skip(f"{library} is not installed: pip install 'gobrrr[zoo]'")


@functools.cache
def _trace(name: str, b: int) -> StepGraph:
    build, seq, precision, _ = CASES[name]
    return capture(lambda: build(b, seq), precision=precision)


@functools.cache
def _family(name: str) -> BatchFamily:
    return family(partial(_trace, name))


@functools.cache
def _h100():
    gpu = get_gpu("h100")
    return gpu, find_calibration(gpu)


def _same_predictions(derived: StepGraph, traced: StepGraph) -> None:
    gpu, cal = _h100()
    m_d, m_t = step_memory(derived, gpu, cal), step_memory(traced, gpu, cal)
    assert (m_d.peak, m_d.reserved, m_d.peak_index) == (m_t.peak, m_t.reserved, m_t.peak_index)
    t_d, t_t = predict(derived, gpu, cal), predict(traced, gpu, cal)
    assert t_d.step_s == pytest.approx(t_t.step_s, rel=1e-9)
    assert t_d.flops == pytest.approx(t_t.flops, rel=1e-9)


@pytest.mark.parametrize("name", BUILT_INS + ZOO)
@pytest.mark.parametrize("b", [3, 8])
def test_derived_graph_is_the_fresh_trace(name, b):
    _needs(name)
    derived, traced = _family(name).at(b), _trace(name, b)
    assert first_mismatch(derived, traced) is None
    assert derived.nodes == traced.nodes  # op, phase, module, shapes, strides, args
    assert derived.storages == traced.storages
    assert derived.meta.tokens == traced.meta.tokens
    assert derived.meta.micro_batch == b
    assert derived.meta.passes[-1] == {"pass": "micro_batch", "micro_batch": b}
    _same_predictions(derived, traced)


@pytest.mark.parametrize("name", BUILT_INS)
def test_builtins_derive_a_batch_of_one_too(name):
    fam, traced = _family(name), _trace(name, 1)
    assert fam.check(traced, 1) is None
    _same_predictions(fam.derive(1), traced)


@pytest.mark.parametrize("name", ZOO)
def test_a_batch_of_one_is_traced_not_derived(name):
    """A size-1 batch specialises: HF's shifted-label loss skips a copy (the slice of a
    one-row batch is already contiguous), channels-last pooling squeezes once more, a clone
    keeps a size-1 dimension's stride. `at(1)` traces it; the derivation would be wrong."""
    _needs(name)
    fam, traced = _family(name), _trace(name, 1)
    assert fam.check(traced, 1) is not None  # what deriving 1 from (2, 4) would get wrong
    one = fam.at(1)
    assert one.nodes == traced.nodes and one.storages == traced.storages
    assert one.meta.passes[-1] == {"pass": "micro_batch", "micro_batch": 1, "traced": True}
    _same_predictions(one, traced)


def test_without_a_trace_function_a_batch_below_b1_is_refused():
    fam = _family("gpt2")
    bare = BatchFamily(_trace("gpt2", 2), 2, _trace("gpt2", 4), 4)
    assert first_mismatch(bare.at(8), fam.at(8)) is None
    with pytest.raises(BatchDependentStructure, match="below the smallest traced one"):
        bare.at(1)


def test_traced_sizes_come_back_unchanged_and_survive_json():
    fam = _family("gpt2")
    for b in TRACE_AT:
        assert first_mismatch(fam.at(b), _trace("gpt2", b)) is None
    g = fam.at(5)
    back = StepGraph.from_json(g.to_json())
    assert back.nodes == g.nodes and back.storages == g.storages and back.meta == g.meta


def test_check_names_the_first_difference():
    fam = _family("gpt2")
    wrong = _trace("gpt2", 8)  # held against the graph at 3
    m = fam.check(wrong, 3)
    first = next(
        i for i, (a, c) in enumerate(zip(fam.at(3).nodes, wrong.nodes, strict=True)) if a != c
    )
    assert m.where == f"node {first} ({wrong.nodes[first].op})"
    assert m.derived != m.traced and "derived" in str(m)


def test_a_quarter_million_tokens_is_a_plain_extrapolation():
    """Far from the traced sizes the derivation holds: tokens, the embedding's output and the
    optimizer's untouched parameter shapes."""
    g = _family("gpt2").at(8192)
    assert g.meta.tokens == 8192 * 32
    emb = next(n for n in g.nodes if n.name == "embedding")
    assert emb.outputs[0].shape == (8192, 32, 768)
    opt = [n for n in g.nodes if n.phase == "optimizer"]
    assert opt == [n for n in _trace("gpt2", 2).nodes if n.phase == "optimizer"]


# -- steps whose structure depends on the batch ---------------------------------------------------


class _Branchy(nn.Module):
    """Runs another op past a batch of 3: the step's structure depends on the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y.relu() if x.shape[0] <= 3 else y.sigmoid()


class _Scaled(nn.Module):
    """Divides by the batch as a float: not an integer that follows it."""

    def forward(self, x):
        return self.lin(x) * (1.0 / x.shape[0])

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)


class _Gram(nn.Module):
    """A batch x batch similarity matrix: its bytes grow with the square of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y @ y.T


class _Half(nn.Module):
    """Keeps the first ceil(b/2) rows: a whole number per two samples, not per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x[: (x.shape[0] + 1) // 2])


def _toy(module: type[nn.Module], b: int) -> StepGraph:
    torch.manual_seed(0)
    return capture(
        lambda: gobrrr.Workload(
            model=module(), batch=(torch.randn(b, 8),), loss=lambda y, batch: y.sum()
        ),
        precision="fp32",
    )


@pytest.mark.parametrize(
    "module, what",
    [
        (
            _Branchy,
            r"node \d+ \(aten\.\w+\.default\): op is 'aten.relu.default' at micro-batch 2 "
            r"and 'aten.sigmoid.default' at 4",
        ),
        (_Scaled, r"args is 0.5 at micro-batch 2 and 0.25 at 4"),
        (_Gram, r"more than one dimension follows the batch"),
    ],
)
def test_a_structure_that_depends_on_the_batch_is_refused(module, what):
    with pytest.raises(BatchDependentStructure, match=what) as e:
        family(partial(_toy, module))
    assert isinstance(e.value, GobrrrError)
    if module is not _Gram:
        assert "the step's structure depends on the micro-batch" in str(e.value)
    assert "each micro-batch must be traced" in str(e.value)


def test_an_integer_that_is_not_whole_per_sample_is_refused_at_odd_batches():
    fam = family(partial(_toy, _Half))
    assert fam.step == 2
    with pytest.raises(
        BatchDependentStructure,
        match=r"micro-batch 3 cannot be derived.*"
        r"changes by 1 between them",
    ):
        fam.at(3)
    assert fam.check(_toy(_Half, 8), 8) is None


def test_bad_micro_batches_are_named():
    g = _trace("mlp", 2)
    with pytest.raises(GobrrrError, match="b1 < b2, got b1=2, b2=2"):
        BatchFamily(g, 2, g, 2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(
            GobrrrError, match=f"micro_batch must be a whole number >= 1, got {bad!r}"
        ):
            _family("mlp").at(bad)


class _FirstCallDiffers(nn.Module):
    """Runs one more op the first time any instance runs in this process, as a scripted
    function under torch.jit's profiling executor does (DeBERTa's attention)."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if type(self).calls == 0:
            y = y.clone()
        type(self).calls += 1
        return y


def test_a_first_trace_that_differs_from_the_later_ones_is_traced_again():
    _FirstCallDiffers.calls = 0
    first, second = _toy(_FirstCallDiffers, 2), _toy(_FirstCallDiffers, 4)
    one_more = r"the number of ops is (\d+) at micro-batch 2 and (?!\1)\d+ at 4"
    with pytest.raises(BatchDependentStructure, match=one_more):
        BatchFamily(first, 2, second, 4)
    _FirstCallDiffers.calls = 0
    fam = family(partial(_toy, _FirstCallDiffers))
    assert fam.check(_toy(_FirstCallDiffers, 8), 8) is None


def test_earlier_passes_are_kept_and_this_one_appended():
    def traced_after_a_pass(b: int) -> StepGraph:
        g = _trace("mlp", b)
        return StepGraph(g.nodes, g.storages, g.meta.replace(passes=({"pass": "earlier"},)))

    g = family(traced_after_a_pass).at(5)
    assert list(g.meta.passes) == [{"pass": "earlier"}, {"pass": "micro_batch", "micro_batch": 5}]


class _Selects(nn.Module):
    """Boolean indexing: traced under the "all-selected" assumption, whose count is in meta."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y[y.sum(-1) > 0]


def test_an_assumed_count_follows_the_batch_in_meta_too():
    fam = family(partial(_toy, _Selects))
    g = fam.at(6)
    assert [a["value"] for a in g.meta.assumptions] == ["6 of 6"]
    assert fam.check(_toy(_Selects, 6), 6) is None
