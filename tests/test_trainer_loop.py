"""The HF Trainer's loop ("hf-trainer", `gobrrr.passes.loop.fp32_copies`): under mixed
precision, the Accelerator that prepared the model copies the fp16/bf16 tensors its forward
returned to fp32 while the originals are still alive. Held against a real
`transformers.Trainer` stepped on the CPU (CPU autocast, bf16), its live tensor bytes counted
by a dispatch mode, with and without Accelerate's wrapper, and against hand sizes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import MethodType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.graph.meta import StepMeta
from gobrrr.passes.loop import loop
from tests.test_loop import _hf, _live_bytes_peak, live_peak, sgd

pytest.importorskip("accelerate")

B, S, D, V = 8, 64, 32, 2000
LOGITS = B * S * V  # elements: bf16 2,048,000 bytes, their fp32 copy 4,096,000
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo"


class FirstTokenLM(nn.Module):
    """Token logits (bf16 under autocast) and a loss on the first token's, upcast to fp32 as
    an HF decoder's loss_function upcasts: the same ops under CPU and CUDA autocast. The loss
    reads a slice, so backward holds little: the peak is where Accelerate copies the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, input_ids, labels, **kwargs):  # kwargs: the Trainer's num_items_in_batch
        logits = self.out(self.emb(input_ids))
        loss = F.cross_entropy(logits[:, 0].float(), labels[:, 0])
        return {"loss": loss, "logits": logits}


def workload() -> gobrrr.Workload:
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    return gobrrr.Workload(model=FirstTokenLM(), batch=batch, optimizer=sgd)


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _module("trainer_fp32_outputs")


def _trainer(bench, fp32_copy: bool, steps: int = 3):
    """3 steps of a real Trainer (bf16 on the CPU) as benchmarks/zoo/loops.py steps it;
    without `fp32_copy`, Accelerate's output wrapper taken off as the GPU script does."""
    w = workload()
    step = bench.hf_trainer_loop(w, w.make_optimizer(), "bf16-mixed", "cpu")
    if not fp32_copy:
        bench.without_fp32_copy(step.trainer.model_wrapped)

    def run():
        for _ in range(steps):
            step()

    return run


def _trainstep(steps: int = 3):
    """3 steps of gobrrr's own step (what capture traces, "drops-output"), bf16 on the CPU."""
    from gobrrr.training.step import TrainStep

    w = workload()
    step = TrainStep(w, w.make_optimizer(), "bf16-mixed", device_type="cpu", keep_loss=False)

    def run():
        for _ in range(steps):
            step()

    return run


def test_the_copy_is_what_the_real_trainer_adds(bench):
    g = capture(workload(), precision="bf16-mixed")
    hf = loop(g, "hf-trainer")
    drops = _live_bytes_peak(_trainstep())
    predicted = live_peak(hf) - live_peak(g)
    # the peak moves to the copy: the forward's saved tensors, the bf16 logits (alive in the
    # wrapper's argument) and their fp32 copy; the Trainer also holds num_items_in_batch
    # (an int64) through its step, which gobrrr's does not
    assert _live_bytes_peak(_trainer(bench, True)) - drops == predicted + 8
    assert predicted > 4 * LOGITS * 0.95
    # the wrapper taken off, the Trainer peaks where gobrrr's step does
    # (num_items_in_batch and one fp32 scalar of its own)
    assert _live_bytes_peak(_trainer(bench, False)) - drops == 12


def test_the_copy_is_an_op_between_the_forward_and_backward():
    g = capture(workload(), precision="bf16-mixed")
    hf = loop(g, "hf-trainer")
    assert hf.meta.loop == "hf-trainer" and len(hf.nodes) == len(g.nodes) + 1
    (o,) = [o for o in g.meta.outputs if o.path == "logits"]
    copy = hf.nodes[o.returned + 1]
    assert copy.op == "aten._to_copy.default" and copy.outputs[0].dtype == "float32"
    assert copy.inputs[0].storage == o.storage and hf.nodes[o.returned + 2].phase == "backward"
    made = hf.storages[copy.allocs[0]]
    assert made.nbytes == 4 * LOGITS and made.created == made.freed == copy.index
    assert hf.storages[o.storage].freed == copy.index  # the bf16 logits, until copied
    assert [n.op for n in hf.nodes if n is not copy] == [n.op for n in g.nodes]
    # the ops after it moved one on, their lifetimes with them
    shifted = {s.id: s for s in hf.storages}
    for s in g.storages:
        if s.id != o.storage and s.created > o.returned:
            assert shifted[s.id].created == s.created + 1
    again = StepMeta.from_dict(hf.meta.to_dict())
    assert again.outputs == hf.meta.outputs and again.loop == "hf-trainer"


def test_fp32_has_nothing_to_copy():
    g = capture(workload(), precision="fp32")
    hf = loop(g, "hf-trainer")
    assert hf.nodes == g.nodes and hf.storages == g.storages


def test_a_kv_cache_is_not_copied():
    """Accelerate walks tuples, lists and dicts: an HF Cache's tensors (attributes of an
    object) stay bf16, the logits are copied."""
    g = capture(_hf("llama"), precision="bf16-mixed")
    cache = [o for o in g.meta.outputs if o.path.startswith("past_key_values")]
    assert cache and not any(o.contained for o in cache)
    assert StepMeta.from_dict(g.meta.to_dict()).outputs == g.meta.outputs
    hf = loop(g, "hf-trainer")
    copies = [s.label for s in hf.storages if s.label.startswith("fp32 copy")]
    assert copies == ["fp32 copy of the output's logits (Accelerate)"]


def test_estimate_names_the_loop_and_the_copy_takes_time():
    kw = {"precision": "bf16-mixed"}
    drop = gobrrr.estimate(workload, "h100", loop="drops-output", **kw)
    hf = gobrrr.estimate(workload, "h100", loop="hf-trainer", **kw)
    assert hf.memory.peak > drop.memory.peak
    assert hf.time.step_s > drop.time.step_s  # the copy reads bf16 and writes fp32
    assert hf.other_loop is not None  # keeps-output, the plain loop
    from gobrrr.report.estimate import estimate_dict

    d = estimate_dict(hf)["loop"]
    assert d["assumes"] == "hf-trainer" and d["other"] == "keeps-output"
    assert "Accelerate copied its fp16/bf16 tensors to fp32" in d["line"]


def test_the_gpu_script_sees_the_conversion(bench):
    """The GPU script's hooks on the CPU: convert_to_fp32 seen with the logits' bytes, and
    gone once the wrapper is taken off."""
    meter = bench.Meter("cpu")
    for fp32_copy, calls in ((True, 3), (False, 0)):
        seen = bench.watch_conversion(meter)
        try:
            _trainer(bench, fp32_copy)()
        finally:
            seen.pop("restore")()
        assert seen.get("calls", 0) == calls
        if calls:
            assert seen["low_bytes"] == 2 * LOGITS and seen["tensors"] == 1


def test_without_fp32_copy_keeps_autocast(bench):
    w = workload()
    step = bench.hf_trainer_loop(w, w.make_optimizer(), "bf16-mixed", "cpu")
    model = step.trainer.model_wrapped
    bench.without_fp32_copy(model)
    assert isinstance(model.forward, MethodType)
    out = model(**w.batch)
    assert out["logits"].dtype == torch.bfloat16  # autocast kept, no fp32 conversion


def test_the_trainer_turns_the_kv_cache_off_and_so_does_the_trace(bench):
    """transformers' Trainer sets model.config.use_cache to TrainingArguments.use_cache (False)
    when it is made: under it a decoder returns no KV cache. "hf-trainer" traces the model so
    configured; the other loops trace it as built; a Workload the caller built gets its
    setting back."""
    from tests.test_loop import _hf

    w = _hf("llama")
    assert w.model.config.use_cache is True
    bench.hf_trainer_loop(w, w.make_optimizer(), "bf16-mixed", "cpu")
    assert w.model.config.use_cache is False  # the real Trainer's doing

    def cache(est):
        return [o for o in est.graph.meta.outputs if o.path.startswith("past_key_values")]

    mine = _hf("llama")
    hf = gobrrr.estimate(mine, "h100", precision="bf16-mixed", loop="hf-trainer")
    assert not cache(hf) and {o.path for o in hf.graph.meta.outputs} == {"loss", "logits"}
    assert mine.model.config.use_cache is True  # put back
    drop = gobrrr.estimate(mine, "h100", precision="bf16-mixed", loop="drops-output")
    assert cache(drop)
    # the real Trainer's step returns what the trace says: the loss and the logits only
    seen = {}
    w = _hf("llama")
    forward = w.model.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen["keys"] = sorted(k for k, v in out.items() if v is not None)
        return out

    w.model.forward = spy
    bench.hf_trainer_loop(w, w.make_optimizer(), "bf16-mixed", "cpu")()
    assert seen["keys"] == ["logits", "loss"]


class CachedLM(FirstTokenLM):
    """FirstTokenLM that also returns a "cache" (its logits doubled) while its config asks."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def forward(self, input_ids, labels, **kwargs):
        out = super().forward(input_ids, labels)
        use = getattr(self.config, "use_cache", False)
        return {**out, "cache": out["logits"] * 2} if use else out


def test_any_config_with_use_cache_is_switched_and_one_without_is_left_alone():
    from types import SimpleNamespace

    def made(config):
        w = workload()
        w.model = CachedLM(config)
        return w

    cfg = SimpleNamespace(use_cache=True)
    hf = gobrrr.estimate(made(cfg), "h100", precision="bf16-mixed", loop="hf-trainer")
    drop = gobrrr.estimate(made(cfg), "h100", precision="bf16-mixed", loop="drops-output")
    assert {o.path for o in drop.graph.meta.outputs} == {"loss", "logits", "cache"}
    assert {o.path for o in hf.graph.meta.outputs} == {"loss", "logits"}
    assert cfg.use_cache is True
    # a config that is no HF config (here a dict) has no flag to switch: traced as built
    odd = gobrrr.estimate(made({"d": D}), "h100", precision="bf16-mixed", loop="hf-trainer")
    assert {o.path for o in odd.graph.meta.outputs} == {"loss", "logits"}
