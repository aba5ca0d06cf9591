"""QLoRA: a 4-bit base model (bitsandbytes NF4, double quantization, bf16 compute) under peft's
LoRA, traced, costed and counted.

Held against independent references: the model `load_in_4bit` builds against the one
transformers' `from_pretrained(..., quantization_config=...)` loads from a checkpoint; the
4-bit storage against the format's closed form (numel/2 bytes of codes, a byte of absmax per
64 elements, an fp32 scale per 256 absmax, a 16- and a 256-entry fp32 code book and an fp32
offset per weight); the traced step's dequantize ops against the layers that run (forward:
every 4-bit linear; backward: those whose input needs a gradient); the dequantize kernel's
bytes against 0.5 + 2 bytes an element plus the absmax; bitsandbytes' 8-bit optimizer states
against 2 bytes an element plus an fp32 scale per 256.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import sys

import pytest
import torch
from torch import nn

from gobrrr.capture import capture
from gobrrr.cli import main
from gobrrr.cost.flops import UNKNOWN_OPS, op_cost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op
from gobrrr.errors import GobrrrError
from gobrrr.hardware import Target
from gobrrr.memory.trainable import trainable
from gobrrr.report.terminal import trainable_line
from gobrrr.workload import Workload

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from gobrrr.training.qlora import load_in_4bit  # noqa: E402

V, R, LAYERS, LINEARS = 128, 8, 2, 7  # vocabulary, LoRA rank; q k v o gate up down a layer
CONFIG = dict(
    vocab_size=V,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
SEQ = 2048  # 2048 rows: CUDA dequantizes, then F.linear (more than capture.bnb.FUSED_MAX_M)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def base_model(config: dict = CONFIG) -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)


def qlora(
    batch: int = 1,
    seq: int = SEQ,
    gc: bool = False,
    optimizer=None,
    config: dict = CONFIG,
    random_b: bool = False,
) -> Workload:
    """A tiny Llama in NF4 under LoRA on q_proj and v_proj, prepared as peft prepares a
    k-bit model. random_b: the adapters' B random (peft starts it at zero: A has no
    gradient)."""
    model = prepare_model_for_kbit_training(
        load_in_4bit(base_model(config)),
        use_gradient_checkpointing=gc,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    lora = LoraConfig(r=R, target_modules=["q_proj", "v_proj"], init_lora_weights=not random_b)
    model = get_peft_model(model, lora)
    ids = torch.randint(0, V, (batch, seq))
    return Workload(
        model, {"input_ids": ids, "labels": ids}, loss=lambda o, b: o.loss, optimizer=optimizer
    )


def linear_shapes(config: dict = CONFIG) -> list[tuple[int, int]]:
    """(out, in) of every linear layer the 4-bit model quantizes (all but the tied head)."""
    return [
        (m.out_features, m.in_features)
        for n, m in base_model(config).named_modules()
        if type(m) is nn.Linear and n != "lm_head"
    ]


def nf4_bytes(n: int) -> int:
    """The closed form of one NF4 weight of n elements with double quantization."""
    blocks = -(-n // 64)
    return n // 2 + blocks + 4 * -(-blocks // 256) + 4 * 16 + 4 * 256 + 4


@pytest.fixture(scope="module")
def graph():
    return capture(qlora, precision="bf16-mixed")


def test_built_as_from_pretrained_loads_it(tmp_path):
    """Every parameter (name, class, dtype, shape) and every quantization state (absmax,
    scales, code books, block sizes) as transformers loads the same weights from disk."""
    from transformers import BitsAndBytesConfig

    base_model().save_pretrained(tmp_path)
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    loaded = LlamaForCausalLM.from_pretrained(
        tmp_path, quantization_config=config, device_map="cpu", dtype=torch.bfloat16
    )
    built = load_in_4bit(base_model(), config)
    assert _layout(built) == _layout(loaded)
    assert built.is_loaded_in_4bit and built.config.quantization_config is config
    q = built.model.layers[0].self_attn.q_proj
    assert torch.equal(q.weight.data, loaded.model.layers[0].self_attn.q_proj.weight.data)


def _layout(model: nn.Module) -> list:
    out = [(n, type(p).__name__, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
    for n, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            s = m.weight.quant_state
            out.append((n, s.blocksize, s.quant_type, s.dtype, tuple(s.shape), s.state2.blocksize))
            out += [(n, t.dtype, tuple(t.shape)) for t in (s.absmax, s.code, s.offset)]
            out += [(n, t.dtype, tuple(t.shape)) for t in (s.state2.absmax, s.state2.code)]
    return out


def test_a_built_model_traces_as_the_function(graph):
    """A QLoRA workload built on real tensors (the user's Params4bit weights) traces as the
    function building it under fake tensors does, and is left as it was: its real step still
    runs after the trace (bitsandbytes' own functions back in place)."""
    w = qlora(batch=1, seq=16)
    g = capture(w, precision="bf16-mixed")
    f = capture(functools.partial(qlora, batch=1, seq=16), precision="bf16-mixed")
    assert _counts(g) == _counts(f) and trainable(g) == trainable(f)
    layer = w.model.base_model.model.model.layers[0].self_attn.k_proj
    assert isinstance(layer.weight, bnb.nn.Params4bit)
    w.model(**w.batch).loss.backward()
    assert (
        w.model.base_model.model.model.layers[1].self_attn.q_proj.lora_A.default.weight.grad
        is not None
    )


def test_four_bit_storage_is_the_closed_form(graph):
    """The base model's 4-bit weights: parameter storage of exactly the closed form, counted
    as nf4 with two elements a byte in the trainable split and its line."""
    shapes = linear_shapes()
    want = sum(nf4_bytes(o * i) for o, i in shapes)
    params = [s for s in graph.storages if s.kind == "parameter"]
    got = sum(
        s.nbytes for s in params if ".base_layer.weight" in s.label or "_proj.weight" in s.label
    )
    assert got == want
    split = trainable(graph)
    nf4 = next(p for p in split.frozen if p.dtype == "nf4")
    assert (nf4.bytes, nf4.elements, nf4.tensors) == (want, sum(o * i for o, i in shapes), 14)
    lora = sum(R * (o + i) for o, i in shapes[0::7] + shapes[2::7])  # q_proj, v_proj
    assert split.trained_elements == lora and split.what == "LoRA adapters"
    assert f"{want / 2**10:,.2f} KiB nf4" in trainable_line(split)


def _counts(g) -> collections.Counter:
    return collections.Counter(
        (n.phase, n.op.split(".")[1]) for n in g.nodes if "bitsandbytes" in n.op
    )


def test_traced_step_dequantizes_as_cuda(graph):
    """Forward: every 4-bit linear dequantizes its absmax, then its weight, then multiplies;
    backward again for each whose input needs a gradient: all but the first layer's q, k, v
    (their input is the frozen embedding's output). The dequantized weight lives from its
    dequantize to its matmul only."""
    n = LAYERS * LINEARS
    assert _counts(graph) == {
        ("forward", "dequantize_blockwise"): n,
        ("forward", "dequantize_4bit"): n,
        ("backward", "dequantize_blockwise"): n - 3,
        ("backward", "dequantize_4bit"): n - 3,
    }
    nodes = graph.nodes
    for node in nodes:
        if node.op == "bitsandbytes.dequantize_4bit.default":
            w = node.outputs[0].storage
            freed = next(m.index for m in nodes[node.index :] if w in m.frees)
            users = [m.op for m in nodes[node.index + 1 : freed + 1] if w in _reads(m)]
            assert "aten.mm.default" in users and freed - node.index <= 4, users


def _reads(node) -> set[int]:
    return {t.storage for t in node.inputs}


def test_checkpointing_recomputes_the_dequantize():
    """peft's checkpointing (the input's gradient required): every layer's backward
    dequantizes; the recompute too, but for each layer's last (down_proj: the autograd function
    saves only the packed weight, so torch's checkpoint stops before it)."""
    n = LAYERS * LINEARS
    g = capture(functools.partial(qlora, gc=True), precision="bf16-mixed")
    counts = _counts(g)
    assert counts[("forward", "dequantize_4bit")] == counts[("backward", "dequantize_4bit")] == n
    assert counts[("recompute", "dequantize_4bit")] == n - LAYERS


def test_dequantize_is_costed_memory_bound(graph):
    """0.5 byte of codes + 4 bytes of absmax per 64 elements read, 2 bytes (bf16) written, one
    FLOP an element; on an H100 far left of the ridge point: memory-bound (a large weight:
    a small one takes the GPU less time than the host takes to issue it)."""
    UNKNOWN_OPS.discard("bitsandbytes.dequantize_4bit.default")
    node = next(n for n in graph.nodes if n.op == "bitsandbytes.dequantize_4bit.default")
    numel = math.prod(node.outputs[0].shape)
    cost = op_cost(node)
    assert cost.bytes == numel / 2 + 4 * numel / 64 + 2 * numel
    assert cost.flops == numel and cost.kind == "pointwise"
    assert "bitsandbytes.dequantize_4bit.default" not in UNKNOWN_OPS
    big = dataclasses.replace(
        node,
        inputs=(_sized(node.inputs[0], 1 << 26), _sized(node.inputs[1], 1 << 21)),
        outputs=(_sized(node.outputs[0], 1 << 27),),  # an 8B model's largest weight
    )
    target = Target.resolve("h100")
    t = time_op(big, op_cost(big), Rates(target.gpu, target.cal))
    assert t.regime == "memory" and t.memory_s > 10 * t.compute_s


def _sized(t, numel: int):
    return dataclasses.replace(t, shape=(numel,), stride=(1,))


def test_few_rows_take_the_fused_kernel():
    """16 rows: CUDA's fused 4-bit matmul, one op, 2·M·N·K FLOPs on the bf16 tensor cores."""
    g = capture(functools.partial(qlora, batch=2, seq=8), precision="bf16-mixed")
    counts = _counts(g)
    assert counts[("forward", "gemm_4bit")] == LAYERS * LINEARS
    assert counts[("forward", "dequantize_4bit")] == 0
    node = next(n for n in g.nodes if n.op == "bitsandbytes.gemm_4bit.default")
    n_out, k = node.arg(2, "shapeB")
    cost = op_cost(node)
    assert cost.flops == 2 * 16 * n_out * k and cost.math == "bf16" and cost.kind == "matmul"


def test_paged_8bit_optimizer_states():
    """PagedAdamW8bit: for adapters of at least 4096 elements, two uint8 states (1 byte an
    element each) and an fp32 absmax per 256; smaller ones two fp32 states. The host waits for
    the GPU after each parameter's update, as bitsandbytes synchronizes there."""
    wide = dict(CONFIG, hidden_size=512, intermediate_size=512)
    paged = functools.partial(
        qlora, seq=64, config=wide, optimizer=lambda p: bnb.optim.PagedAdamW8bit(p, lr=1e-4)
    )
    g = capture(paged, precision="bf16-mixed")
    shapes = linear_shapes(wide)
    adapters = [n for o, i in shapes[0::7] + shapes[2::7] for n in (R * i, o * R)]
    want = sum(2 * n + 2 * 4 * -(-n // 256) if n >= 4096 else 2 * 4 * n for n in adapters)
    qmaps = 2 * 256 * 4  # the signed and unsigned code books, shared
    assert trainable(g).optimizer_states_bytes == want + qmaps
    updates = [n.index for n in g.nodes if n.op.startswith("bitsandbytes.optimizer_update")]
    assert len(updates) == len(adapters)
    assert set(updates) <= set(g.meta.syncs)


def test_a_plan_applies_to_the_4bit_model():
    """Micro-batches, accumulation, checkpointing every layer and the fused loss applied to a
    real QLoRA model step it on the CPU, its adapters' gradients those of the plain step."""
    from gobrrr.plan.apply import apply
    from gobrrr.plan.knobs import Knobs

    def grads(model) -> dict:
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    torch.manual_seed(0)
    ref = qlora(batch=2, seq=32, random_b=True)
    ref.model(**ref.batch).loss.backward()
    want = grads(ref.model)
    torch.manual_seed(0)
    wl = qlora(batch=2, seq=32, random_b=True)
    layers = [f"base_model.model.model.layers.{i}" for i in range(LAYERS)]
    knobs = Knobs(1, 2, checkpoint=tuple((b, "full") for b in layers), fused_loss=True)
    step = apply(wl, knobs, "fp32")
    got = {}
    step.optimizer.register_step_pre_hook(lambda *_: got.update(grads(wl.model)))
    step()
    assert len(want) == 8 and got.keys() == want.keys()
    for n, g in want.items():
        # the 4-bit layers compute in bf16: split into micro-batches, their matmuls round
        # differently (bf16 has 8 bits of mantissa); a wrong gradient is off by far more
        torch.testing.assert_close(
            got[n], g, rtol=2e-2, atol=1e-4,
            msg=lambda m, n=n: f"{n}: {m}",
        )  # fmt: skip


IN_FUNCTION = """
import torch
from gobrrr import Workload


def qlora():
    import {lib}
    return Workload(torch.nn.Linear(2, 2), torch.zeros(1, 2), loss=lambda o, b: o.sum())
"""
AT_IMPORT = "import {lib}\n" + IN_FUNCTION


@pytest.mark.parametrize(
    "lib, text, extra",
    [
        ("bitsandbytes", IN_FUNCTION, "qlora"),
        ("bitsandbytes", AT_IMPORT, "qlora"),
        ("peft", IN_FUNCTION, "lora"),
    ],
)
def test_missing_library_is_one_line(lib, text, extra, tmp_path, monkeypatch, capfd):
    """A workload that imports bitsandbytes or peft where it is not installed: one line naming
    the library and the extra that installs it, exit code 2; the same from Python."""
    (tmp_path / "w.py").write_text(text.format(lib=lib))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GOBRRR_DEBUG", raising=False)
    monkeypatch.setitem(sys.modules, lib, None)  # import raises ModuleNotFoundError
    code = main(["estimate", "w.py:qlora", "--gpu", "h100"])
    out, err = capfd.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"needs {lib}, which is not installed" in err and f"gobrrr[{extra}]" in err, err
    if text is IN_FUNCTION:
        scope = {}
        exec(text.format(lib=lib), scope)
        with pytest.raises(GobrrrError, match=f"needs {lib}.*gobrrr\\[{extra}\\]"):
            capture(scope["qlora"])
