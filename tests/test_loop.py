"""The training loop (`gobrrr.passes.loop`): a loop that keeps `out = model(...)` alive holds
exactly the model's output longer than gobrrr's step, which drops it. Held against hand
sizes and against the same two loops run for real on the CPU, their live tensor bytes
counted by a dispatch mode; the time is the same under both loops."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gobrrr
from gobrrr.capture import capture
from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import StepGraph
from gobrrr.graph.meta import StepMeta
from gobrrr.passes.loop import held, loop
from gobrrr.report.estimate import estimate_dict

B, D, H, V = 32, 64, 128, 1000  # the output: fp32 [32, 1000] = 128,000 bytes (250 blocks)
OUT_BYTES = B * V * 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, V)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, D, generator=g), torch.randint(0, V, (B,), generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, foreach=True)


def ce(m, b):
    return F.cross_entropy(m(b[0]), b[1])


def keeps(m, b):  # the plain loop's body as a forward_backward: `out` held through backward
    out = m(b[0])
    loss = F.cross_entropy(out, b[1])
    loss.backward()
    return loss


def workload(**kw):
    kw.setdefault("step", None if "forward_backward" in kw else ce)
    return gobrrr.Workload(model=Net(), batch=batch(), optimizer=sgd, **kw)


def live_peak(graph: StepGraph) -> int:
    """Most bytes alive at once during the step, exact (no rounding): the storages alive at
    its start, then each op's allocations, then its frees."""
    sizes = [s.nbytes for s in graph.storages]
    live = sum(
        sizes[s.id] for s in graph.storages if s.created < 0 and (s.freed is None or s.freed >= 0)
    )
    peak = live
    for n in graph.nodes:
        live += sum(sizes[i] for i in n.allocs)
        peak = max(peak, live)
        live -= sum(sizes[i] for i in n.frees)
    return peak


@pytest.fixture(scope="module")
def traced():
    return capture(workload(), precision="fp32")


def test_capture_marks_the_output_and_keeping_it_costs_its_bytes(traced):
    assert traced.meta.loop == "drops-output"
    (o,) = held(traced)
    assert (o.path, o.shape, o.dtype) == ("output", (B, V), "float32")
    kept = loop(traced, "keeps-output")
    assert kept.meta.loop == "keeps-output"
    assert live_peak(kept) - live_peak(traced) == OUT_BYTES
    assert loop(traced, "drops-output") is traced


def _live_bytes_peak(run) -> int:
    """Peak bytes of the storages the ops of `run()` make, alive at once (real CPU tensors)."""
    live: dict[int, int] = {}
    state = {"now": 0, "peak": 0}

    def died(key, n):
        if live.pop(key, None) is not None:
            state["now"] -= n

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    key = st.data_ptr()
                    if key and key not in live:
                        live[key] = st.nbytes()
                        state["now"] += st.nbytes()
                        weakref.finalize(st, died, key, st.nbytes())
            state["peak"] = max(state["peak"], state["now"])
            return out

    with Count():
        run()
    return state["peak"]


def _plain(keep: bool, steps: int = 3):
    torch.manual_seed(0)
    model, (x, y) = Net(), batch()
    opt = sgd(model.parameters())

    def run():
        for _ in range(steps):
            if keep:  # the plain loop: `out` lives until it is rebound next step
                out = model(x)
                loss = F.cross_entropy(out, y)
            else:  # HF Trainer's shape: the output dropped once the loss is taken
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

    return run


def test_the_difference_is_what_real_loops_hold(traced):
    measured = _live_bytes_peak(_plain(True)) - _live_bytes_peak(_plain(False))
    predicted = live_peak(loop(traced, "keeps-output")) - live_peak(traced)
    assert measured == predicted == OUT_BYTES


def _forward_peak(run) -> int:
    """Most bytes alive at once while the first step's forward runs (real CPU tensors): the
    dispatch-mode count of `_live_bytes_peak`, stopped as backward starts."""

    class Stop(Exception):
        pass

    def forward_only():
        orig = torch.Tensor.backward

        def stop(*a, **k):
            raise Stop

        torch.Tensor.backward = stop
        try:
            run()
        except Stop:
            pass
        finally:
            torch.Tensor.backward = orig

    return _live_bytes_peak(forward_only)


def test_the_first_step_has_no_previous_output_to_keep(traced):
    """In a process's first step there is no earlier `out`: the replay leaves the previous
    step's output (`carried`) out of it, where the first step's segments are mapped, and
    holds it from the second step on."""
    from gobrrr.memory.replay import replay

    real = _forward_peak(_plain(True, steps=1)) - _forward_peak(_plain(False, steps=1))
    kept = loop(traced, "keeps-output")
    assert [s.label for s in kept.storages if s.carried] == ["previous step's output"]
    (returned,) = {o.returned for o in kept.meta.outputs}

    def model_peak(graph, steps):  # the replay's last step, until the model has returned
        return max(replay(graph, steps=steps).timeline[: returned + 1])

    assert real == 0  # the first step: both loops hold the same bytes through the forward
    assert model_peak(kept, 1) - model_peak(traced, 1) == real
    # from the second step on, last step's output is alive until the model returns
    assert model_peak(kept, 2) - model_peak(traced, 2) == OUT_BYTES


def _zero_grad_first(steps: int = 3):
    """timm's and torchvision's train_one_epoch: `output` kept, zero_grad() just before
    backward, so last step's gradients are alive through the forward."""
    torch.manual_seed(0)
    model, (x, y) = Net(), batch()
    opt = sgd(model.parameters())

    def run():
        for _ in range(steps):
            output = model(x)
            loss = F.cross_entropy(output, y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    return run


def test_zero_grad_first_holds_last_steps_gradients_through_the_forward(traced):
    measured = _live_bytes_peak(_zero_grad_first()) - _live_bytes_peak(_plain(False))
    zgf = loop(traced, "zero-grad-first")
    assert zgf.meta.loop == "zero-grad-first"
    # the peak is the forward's loss, where the loop's previous `loss` (an fp32 scalar,
    # alive until rebound) is alive too: 4 bytes (a 512-byte block on a GPU) not modelled
    assert measured == live_peak(zgf) - live_peak(traced) + 4
    grads = sum(p.numel() * 4 for p in Net().parameters())
    # the peak moves to the forward's end: the weights' gradients on top of the output
    assert measured > live_peak(loop(traced, "keeps-output")) - live_peak(traced)
    assert (
        sum(s.nbytes for s in zgf.storages if s.label.startswith("previous step's grad")) == grads
    )


def test_forward_backward_traces_what_the_function_holds(traced):
    fb = capture(workload(forward_backward=keeps), precision="fp32")
    assert fb.meta.loop == "forward-backward"
    phases = [n.phase for n in fb.nodes]
    assert phases.index("backward") > phases.index("forward")
    assert [n.op for n in fb.nodes] == [n.op for n in traced.nodes]
    # `out` dies when the function returns, after backward: held longer than TrainStep's
    (o,) = fb.meta.outputs
    assert fb.storages[o.storage].freed > traced.storages[held(traced)[0].storage].freed
    with pytest.raises(GobrrrError, match="leave --loop out"):
        loop(fb, "keeps-output")


def test_estimate_says_which_loop_and_what_the_other_adds():
    keep = gobrrr.estimate(lambda: workload(), "h100", precision="fp32")
    drop = gobrrr.estimate(lambda: workload(), "h100", precision="fp32", loop="drops-output")
    assert keep.graph.meta.loop == "keeps-output"  # the default
    assert keep.time.step_s == drop.time.step_s  # only lifetimes change
    assert keep.other_loop.peak == drop.memory.peak
    assert drop.other_loop.peak == keep.memory.peak
    assert keep.memory.peak - drop.memory.peak == OUT_BYTES
    d = estimate_dict(drop)["loop"]
    assert d["assumes"] == "drops-output" and d["other"] == "keeps-output"
    assert d["other_minus_this_bytes"] == OUT_BYTES
    assert d["held"] == [
        {"path": "output", "dtype": "float32", "shape": [B, V], "bytes": OUT_BYTES}
    ]
    assert "holds +0.1 MiB more: the output (float32 [32, 1000])" in d["line"]


def test_meta_round_trip(traced):
    kept = loop(traced, "keeps-output")
    again = StepMeta.from_dict(kept.meta.to_dict())
    assert again.outputs == kept.meta.outputs and again.loop == "keeps-output"


# -- forward_backward: the user's own step ---------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_accumulated_forward_backward_gives_trainstep_gradients_bit_for_bit(n):
    from gobrrr.training.step import TrainStep

    def params_after(**kw):
        torch.manual_seed(0)
        w = workload(**kw)
        x, y = w.batch
        w.batch = (torch.cat([x] * 3), torch.cat([y] * 3))  # 96 samples: 2 or 3 micro-batches
        step = TrainStep(w, w.make_optimizer(), "fp32", device_type="cpu", accumulation=n)
        loss = step()
        return [p.detach().clone() for p in w.model.parameters()], loss

    ref, ref_loss = params_after()
    got, got_loss = params_after(forward_backward=keeps)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert torch.equal(ref_loss, got_loss)


def _no_backward(m, b):
    return F.cross_entropy(m(b[0]), b[1])


def _steps_itself(m, b):
    loss = keeps(m, b)
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    return loss


def _no_loss(m, b):
    keeps(m, b)


@pytest.mark.parametrize(
    "fn,message",
    [
        (_no_backward, "produced no gradient: it never called backward"),
        (_steps_itself, r"called SGD.step\(\) itself"),
        (_no_loss, r"returned None \(NoneType\), not the loss"),
    ],
)
def test_bad_forward_backward_is_one_clear_error(fn, message):
    with pytest.raises(GobrrrError, match=message):
        capture(workload(forward_backward=fn), precision="fp32")


@pytest.mark.parametrize("other", ["loss", "step"])
def test_forward_backward_with_loss_or_step_is_refused(other):
    kw = {"loss": lambda out, b: out.sum(), "step": ce}[other]
    with pytest.raises(GobrrrError, match=f"both forward_backward= and {other}="):
        gobrrr.Workload(model=Net(), batch=batch(), forward_backward=keeps, **{other: kw})


def test_cli_loop_flag_and_errors(tmp_path, capsys):
    from gobrrr.cli.app import main

    src = tmp_path / "w.py"
    src.write_text(
        "import torch, torch.nn as nn\nimport gobrrr\n"
        "def workload():\n"
        "    m = nn.Linear(8, 4)\n"
        "    return gobrrr.Workload(model=m, batch=torch.randn(2, 8), "
        "forward_backward=lambda m, b: m(b).sum())\n"
    )
    assert main(["estimate", f"{src}:workload", "--precision", "fp32", "--json"]) == 2
    assert "never called backward" in capsys.readouterr().out
    assert main(["estimate", "--model", "mlp", "--loop", "sideways"]) == 2
    assert "unknown loop 'sideways'" in capsys.readouterr().err


# -- HF models and the benchmark's loops, against the same loops run for real ----------------

S = 32  # tokens per sample of the HF models; their logits: fp32 [2, 32, 1000] = 256,000 bytes
HF_LOGITS = 2 * S * V * 4


def _hf(name: str) -> gobrrr.Workload:
    """A tiny HF model whose forward returns a ModelOutput with the loss (computed inside the
    forward from `labels`) and, for Llama, a KV cache. Llama has as many KV heads as query
    heads: with fewer, the CPU's attention saves the un-repeated keys for backward while the
    trace takes Hopper's backends, which do not (a kernel difference, not the loop's)."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    if name == "llama":
        cfg = LlamaConfig(**small, num_attention_heads=4, num_key_value_heads=4, vocab_size=V)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = BertConfig(**small, num_attention_heads=4, vocab_size=V, hidden_dropout_prob=0.0)
        model = BertForMaskedLM(
            cfg.__class__(**{**cfg.to_dict(), "attention_probs_dropout_prob": 0.0})
        )
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(0))
    return gobrrr.Workload(model=model, batch={"input_ids": ids, "labels": ids}, optimizer=sgd)


def _hf_loop(name: str, keep: bool, steps: int = 3):
    w = _hf(name)
    opt = w.make_optimizer()

    def run():
        for _ in range(steps):
            if keep:  # `out` (logits, cache, loss) alive until the next forward returns
                out = w.model(**w.batch)
                loss = out.loss
            else:
                loss = w.model(**w.batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()

    return run


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_hf_models_keep_what_the_real_loop_keeps(name):
    g = capture(_hf(name), precision="fp32")
    paths = {o.path.split(".")[0] for o in held(g)}
    assert {"logits"} | ({"past_key_values"} if name == "llama" else set()) <= paths
    measured = _live_bytes_peak(_hf_loop(name, True)) - _live_bytes_peak(_hf_loop(name, False))
    predicted = live_peak(loop(g, "keeps-output")) - live_peak(g)
    # one output at the peak (backward's first op): the logits; the cache and the loss are
    # alive there under both loops
    assert measured == predicted == HF_LOGITS


def _bench_loops():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo" / "loops.py"
    spec = importlib.util.spec_from_file_location("bench_loops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmark_loops_hold_one_output_as_the_real_loop_does():
    """benchmarks/zoo/loops.py's plain loop is the for loop: the previous step's output goes
    when the forward returns, not when the step ends (then two outputs are alive through
    backward)."""
    bench = _bench_loops()
    drop = _live_bytes_peak(_hf_loop("bert", False))

    w = _hf("bert")
    step = bench.plain_loop(w, w.make_optimizer(), "fp32", "cpu")

    def bench_run():
        for _ in range(3):
            step()

    assert _live_bytes_peak(bench_run) - drop == HF_LOGITS
