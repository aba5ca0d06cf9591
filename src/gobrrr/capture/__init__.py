"""Trace one training step on fake tensors into a StepGraph.

    graph = capture(lambda: get_workload("gpt2", 8, 1024), precision="bf16-mixed")

The workload is built inside `FakeTensorMode`, so no memory is allocated and nothing is
computed: a 70B model traces on a laptop. One untraced warm-up step creates the optimizer
state; the second, steady-state step is recorded: forward, loss, backward, optimizer step,
zero_grad. Tensors live on the CPU during the trace; CUDA's autocast rules and CUDA's
default optimizer implementation (foreach) are reproduced so dtypes and allocations are
those of a CUDA run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from gobrrr.capture import accumulate, assume, bnb, compiled, optim_state
from gobrrr.capture.autocast import cuda_autocast_rules
from gobrrr.capture.cuda_calls import on_traced_gpu
from gobrrr.capture.dropout import cuda_dropout
from gobrrr.capture.libraries import real_to_libraries
from gobrrr.capture.recorder import Recorder, StorageTable
from gobrrr.capture.rnn import cuda_rnn
from gobrrr.capture.saved import SavedTracker
from gobrrr.capture.sdpa import SdpaTarget, cuda_sdpa
from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import StepGraph
from gobrrr.graph.meta import OptimizerInfo, StepMeta, Tf32
from gobrrr.passes.compile import inductor
from gobrrr.precision import Precision
from gobrrr.training.checkpointing import (
    apply_checkpointing,
    block_names,
    checkpoint_meta,
    checkpointed,
)
from gobrrr.training.fused_loss import as_on_cuda
from gobrrr.training.optimizers import LARGE_TENSOR_BYTES, optimizer_key
from gobrrr.training.qlora import INSTALL, missing
from gobrrr.training.step import TrainStep, make_scaler, split_batch
from gobrrr.workload import Workload, embedding_only_params, iter_tensors, map_tensors

CHECKPOINTS = ("none", "full")

WorkloadSource = Workload | Callable[[], Workload]


class _Driver:
    """Tracks the phase and the innermost module while the step runs.

    Forward (and recompute): a stack pushed and popped by global module forward hooks.
    Backward: a pre-hook on the autograd node of each module's output sets the module when
    backward enters it, and one on the node of each input sets the parent when it leaves.
    (torch's ModuleTracker does this with tensor hooks that keep checkpointed recomputations
    alive, which would distort the memory being measured.)"""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        self.phase = "forward"
        self.stack: list[str] = []
        self.backward_module = ""
        self.on_output: Callable[[Any], None] | None = None  # the model's forward returned

    def module(self) -> str:
        inner = compiled.current_module()
        if inner is not None:  # an op of a compiled graph: the module that made its node
            return inner
        if self.stack:  # inside a forward (or a recomputed forward during backward)
            return self.stack[-1]
        return self.backward_module if self.phase == "backward" else ""

    def current_phase(self) -> str:
        # a checkpoint around a compiled block runs its forward graph again, outside any call
        if self.phase == "backward" and (self.stack or compiled.current_kind() == "forward"):
            return "recompute"
        return self.phase

    def _set(self, name: str):
        def hook(grad_outputs):
            self.backward_module = name

        return hook

    def pre(self, mod, args) -> None:
        if torch.compiler.is_compiling():  # dynamo traces the model: not a module call
            return
        self.stack.append(self.names.get(id(mod), type(mod).__name__))

    def post(self, mod, args, out) -> None:
        if torch.compiler.is_compiling():
            return
        name = self.stack.pop() if self.stack else ""
        if self.phase != "forward" or not torch.is_grad_enabled():
            return
        if name == "" and self.on_output is not None:  # the whole model returned `out`
            self.on_output(out)
        parent = name.rpartition(".")[0]
        for t in iter_tensors(out):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(self._set(name))
        for t in iter_tensors(args):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(self._set(parent))


@contextlib.contextmanager
def _module_hooks(driver: _Driver) -> Iterator[None]:
    h1 = torch.nn.modules.module.register_module_forward_pre_hook(driver.pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(driver.post, always_call=True)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def _converter(fn: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, Any]):
    """t -> fn(t), a Parameter again if t was one, once per tensor (`memo` by id), so tied
    parameters stay tied."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            new = fn(t.detach())
            memo[id(t)] = (
                torch.nn.Parameter(new, t.requires_grad)
                if isinstance(t, torch.nn.Parameter)
                else new
            )
        return memo[id(t)]

    return convert


def _convert_tensors(
    model: torch.nn.Module,
    fn: Callable[[torch.Tensor], torch.Tensor],
    recurse: bool = True,
    only: Callable[[torch.Tensor], bool] = lambda t: True,
) -> None:
    """Replace every parameter and buffer (for which `only` holds) by fn(it), keeping tied
    parameters tied. (Module.to and _apply cannot swap fake tensors.)"""
    convert = _converter(fn, {})
    for mod in model.modules() if recurse else [model]:
        for name, p in list(mod._parameters.items()):
            if p is not None and only(p):
                mod._parameters[name] = convert(p)
        for name, b in list(mod._buffers.items()):
            if b is not None and only(b):
                mod._buffers[name] = convert(b)


def _to_fake(workload: Workload, mode: FakeTensorMode, values: assume.Values) -> Workload:
    """A fake copy of a workload built from real tensors (same structure, no memory); the
    user's model is left untouched."""
    memo: dict[int, Any] = {}
    fake = _faker(mode, values)
    convert = _converter(fake, memo)
    with unset_fake_temporarily():
        quant = [t for _, t in bnb.quant_tensors(workload.model)]
        for t in [*workload.model.parameters(), *workload.model.buffers(), *quant]:
            if isinstance(t, torch._subclasses.FakeTensor):
                memo[id(t)] = t  # already fake: shared, not copied
            else:
                convert(t)
        batch = map_tensors(workload.batch, fake)
    model = copy.deepcopy(workload.model, memo)  # the memo hands deepcopy the fake tensors
    return dataclasses.replace(workload, model=model, batch=batch)


def _faker(mode: FakeTensorMode, values: assume.Values) -> Callable[[torch.Tensor], Any]:
    return lambda t: assume.fake_copy(t, mode, values.table)


@contextlib.contextmanager
def _replacing_apply() -> Iterator[None]:
    """While the user's workload is built: Module.to(dtype / memory_format), .half(),
    .bfloat16() and the like replace parameters and buffers by their converted copies.
    PyTorch's Module._apply swaps each fake parameter with its copy in place
    (torch.utils.swap_tensors), which fake tensors refuse (they carry weakrefs), so a model
    converted inside a workload function could not be traced otherwise."""
    original = torch.nn.Module._apply

    def _apply(self, fn, recurse=True):
        _convert_tensors(self, fn, recurse)
        return self

    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = original


def _build(source: WorkloadSource, mode: FakeTensorMode, values: assume.Values) -> Workload:
    """The workload, every tensor in it fake. A function is called under `mode` with small
    tensors real (assume.RealSmall: constructors may read what they compute), and the CPU's
    random state is restored afterwards; what is left real is made fake, with the facts its
    values give (integer batches: their range)."""
    if isinstance(source, Workload):
        w = source
        if any(not isinstance(p, torch._subclasses.FakeTensor) for p in w.model.parameters()):
            w = _to_fake(w, mode, values)
        return w
    real = assume.RealSmall()
    try:
        with torch.random.fork_rng(devices=[]), _replacing_apply(), real:
            w = source()
    except GobrrrError:
        raise
    except ModuleNotFoundError as e:
        if e.name in INSTALL:  # peft, bitsandbytes: a library the workload's model needs
            raise missing(e.name, "the workload") from e
        raise GobrrrError(f"building the workload raised {type(e).__name__}: {e}") from e
    except Exception as e:
        raise GobrrrError(f"building the workload raised {type(e).__name__}: {e}") from e
    if not isinstance(w, Workload):
        raise GobrrrError(
            f"the workload function returned {type(w).__name__}, expected a gobrrr.Workload"
        )
    return _fake_rest(w, mode, values, real.made)


def _fake_rest(w: Workload, mode: FakeTensorMode, values: assume.Values, made) -> Workload:
    """Make the real tensors a built workload holds fake: in place where the build made them
    all, on a copy of the model where some came from outside (the user's stay untouched)."""
    tensors = [*w.model.parameters(), *w.model.buffers()]
    reals = [t for t in tensors if not isinstance(t, torch._subclasses.FakeTensor)]
    if reals and not all(made(t) for t in reals):
        return _to_fake(w, mode, values)
    with unset_fake_temporarily():  # conversions of real tensors, outside the fake mode
        if reals:
            _convert_tensors(
                w.model,
                _faker(mode, values),
                only=lambda t: not isinstance(t, torch._subclasses.FakeTensor),
            )
        bnb.fake_quant_states(w.model, _faker(mode, values))
        return dataclasses.replace(w, batch=map_tensors(w.batch, _faker(mode, values)))


def _prepare(w: Workload, precision: Precision) -> Workload:
    if precision.casts_weights:
        dtype = precision.param_dtype
        _convert_tensors(w.model, lambda t: t.to(dtype) if t.is_floating_point() else t)
        w = dataclasses.replace(
            w, batch=map_tensors(w.batch, lambda t: t.to(dtype) if t.is_floating_point() else t)
        )
    return w


def _cuda_optimizer_defaults(opt: torch.optim.Optimizer) -> None:
    """CUDA picks the foreach implementation when neither foreach nor fused is chosen; on the
    CPU (and for fake tensors) torch would pick the per-tensor loop. Choose what CUDA would."""
    for g in opt.param_groups:
        if "foreach" in g and g.get("foreach") is None and not g.get("fused"):
            g["foreach"] = True


class _Step(TrainStep):
    """The traced step: gobrrr.training.step.TrainStep on fake tensors, autocast on the CPU under
    CUDA's rules, the loss freed after backward as in a real step; the same code for the
    warm-up and the recorded step. Two differences, both for the trace: the phases set the
    driver's phase, and the fp16 optimizer step does GradScaler.step's ops without its
    value read (see optimizer_step)."""

    def __init__(
        self,
        w: Workload,
        precision: Precision,
        driver: _Driver | None = None,
        accumulation: int = 1,
    ) -> None:
        opt = w.make_optimizer()
        _cuda_optimizer_defaults(opt)
        super().__init__(
            w,
            opt,
            precision,
            device_type="cpu",
            accumulation=accumulation,
            scaler=make_scaler(precision, "cpu"),
            keep_loss=False,
        )
        self.driver = driver
        self.syncs: list[int] = []  # where the real step makes the host wait for the GPU
        self.recorder: Recorder | None = None

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        if self.driver is not None:
            self.driver.phase = name
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """TrainStep.backward; while recording, the engine's gradient sums are flagged
        (`accumulate.watch`)."""
        handles = accumulate.watch(loss, self.recorder) if self.recorder is not None else []
        try:
            super().backward(loss)
        finally:
            for h in handles:
                h.remove()
            if self.recorder is not None:
                self.recorder.after_node = None

    def user_backward(self, run, tensors):
        """TrainStep.user_backward (a backward the workload's forward_backward started), the
        engine's gradient sums flagged as in `backward`."""
        handles = []
        if self.recorder is not None:
            for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
                handles += accumulate.watch(t, self.recorder)
        try:
            return super().user_backward(run, tensors)
        finally:
            for h in handles:
                h.remove()
            if self.recorder is not None:
                self.recorder.after_node = None

    def init_optimizer_state(self) -> None:
        """What a warm-up step leaves behind, without its forward and backward: the optimizer
        state (created lazily by the first step). Gradients of zeros stand in for real ones.
        torch's Adam and AdamW get their state made directly, without the step's update
        (`optim_state`); any other optimizer, or a step through the GradScaler, runs it."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        if not self.scaler and optim_state.direct(self.optimizer):
            optim_state.init_state(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
            return
        if self.scaler:
            self.scaler.scale(torch.zeros((), dtype=torch.float32))  # creates its scale tensor
        self.optimizer_step()

    def optimizer_step(self) -> None:
        if not self.scaler:
            return super().optimizer_step()
        # GradScaler.step() reads found_inf with .item(): do its ops, not that read ...
        self.scaler.unscale_(self.optimizer)
        if self.recorder is not None:  # ... but remember that the host waits there
            self.syncs.append(len(self.recorder.nodes) - 1)
        self.optimizer.step()
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


def _optimizer_meta(opt: torch.optim.Optimizer) -> OptimizerInfo:
    """The optimizer as the time model looks its host cost up (`Calibration.optimizer_host`):
    its class and implementation, the parameter tensors it steps and how many of those are
    large (over LARGE_TENSOR_BYTES)."""
    groups = opt.param_groups
    params = [p for g in groups for p in g["params"] if p.requires_grad]
    return OptimizerInfo(
        key=optimizer_key(opt),
        tensors=len(params),
        large=sum(1 for p in params if p.numel() * p.element_size() > LARGE_TENSOR_BYTES),
    )


def _register_state(table: StorageTable, w: Workload, opt: torch.optim.Optimizer) -> None:
    names = {id(p): n for n, p in w.model.named_parameters(remove_duplicate=False)}
    for n, p in w.model.named_parameters():
        table.register(p, "parameter", label=n)
    for n, b in w.model.named_buffers():
        table.register(b, "buffer", label=n)
    for n, t in bnb.quant_tensors(w.model):  # a 4-bit weight's scales: part of the weight
        table.register(t, "parameter", label=n)
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                sid = table.register(v, "optimizer_state", label=f"{names.get(id(p), '?')}.{k}")
                if k == "step" and v.numel() == 1 and not opt.defaults.get("fused"):
                    table.records[sid].host = True  # a CPU scalar on CUDA runs (not capturable)
    for t in iter_tensors(w.batch):
        table.register(t, "input")


def _classify(table: StorageTable, nodes: list) -> None:
    """Name what the anonymous storages were: gradients, activations, temporaries."""
    first_bwd = next((n.index for n in nodes if n.phase == "backward"), len(nodes))
    for r in table.records:
        if r.kind == "temporary" and r.created >= 0 and r.created < first_bwd:
            if r.freed is None or r.freed >= first_bwd:
                r.kind = "activation"


def _mark_grads(table: StorageTable, w: Workload, names: dict[int, str]) -> None:
    for p in w.model.parameters():
        if p.grad is not None:
            sid = table.lookup(p.grad)
            if sid is not None:
                table.records[sid].kind = "gradient"
                table.records[sid].label = f"{names.get(id(p), '?')}.grad"


def capture(
    source: WorkloadSource,
    *,
    precision: str = "bf16-mixed",
    checkpoint: str | Mapping[str, str] = "none",
    sdpa: SdpaTarget | None = None,
    accumulation: int = 1,
    compile: bool | str = False,
) -> StepGraph:
    """Trace one steady-state training step of `source` (a Workload, or a function returning
    one, called under fake tensors) and return its StepGraph. `checkpoint`: "none", "full"
    (every repeated block) or {block name: "full" | "selective"}. `sdpa`: the GPU whose
    attention backends F.scaled_dot_product_attention takes in the trace (default: Hopper's).
    `accumulation`: the workload's batch runs as this many micro-batches before the optimizer
    step (the planner derives this from a one-micro-batch trace: `passes.accumulate`).
    `compile`: the model runs under torch.compile (the optimizer eager): the forward and
    backward are the graphs AOTAutograd partitions (`gobrrr.capture.compiled`), and what
    Inductor fuses is not allocated (`gobrrr.passes.compile.inductor`). "model" (or True):
    torch.compile(model); "blocks": each repeated block's forward compiled on its own, the
    rest eager, a checkpointed block's checkpoint around its compiled forward."""
    precision = Precision.parse(precision)
    how = compiled.mode(compile)
    if isinstance(checkpoint, str) and checkpoint not in CHECKPOINTS:
        raise GobrrrError(
            f"unknown checkpoint mode {checkpoint!r}: "
            f"choose {', '.join(CHECKPOINTS)} or a {{block: policy}} mapping"
        )
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    rules = cuda_autocast_rules() if precision.is_mixed else contextlib.nullcontext()
    values = assume.Values()
    regions = compiled.Regions() if how != "none" else None
    sdpa = sdpa or SdpaTarget()
    with (
        on_traced_gpu(sdpa.capability),
        mode,
        assume.ValueMode(values),
        rules,
        cuda_dropout(),
        cuda_rnn(),
        as_on_cuda(),
        cuda_sdpa(sdpa) as chosen,
        compiled.compiling() if regions is not None else contextlib.nullcontext(),
    ):
        w = _prepare(_build(source, mode, values), precision)
        names = block_names(w.model)
        if how == "blocks":  # before checkpointing, which then wraps the compiled forwards
            _compile_blocks(w.model, names, regions)
        blocks = _checkpoint(w.model, checkpoint)
        chosen.chosen.clear()  # the recorded step's calls only, not the warm-up's
        with real_to_libraries(values.answerable), bnb.cuda_4bit(values):
            graph = _trace(
                w,
                precision,
                values,
                on_step=chosen.chosen.clear,
                accumulation=accumulation,
                regions=regions,
                whole=how == "model",
            )
    meta = graph.meta.replace(
        checkpoint=checkpoint_meta(checkpointed(w.model), names),
        checkpointed_blocks=len(blocks),
        blocks=tuple(_in_forward_order(names, graph)),
        sdpa_backends=dict(chosen.chosen),
        assumptions=tuple(a.to_dict() for a in values.assumptions()),
        syncs=tuple(sorted({*graph.meta.syncs, *values.syncs})),
    )
    graph = dataclasses.replace(graph, meta=meta)
    if regions is None:
        return graph
    return inductor(compiled.tag(graph, regions))


def _compile_blocks(model: torch.nn.Module, names: list[str], regions) -> None:
    if not names:
        raise GobrrrError(
            "compile='blocks' found no repeated blocks (an nn.ModuleList or nn.Sequential of "
            "two or more modules of one class) to compile in this model: compile the whole "
            "model (compile='model', --compile)"
        )
    compiled.compile_blocks(model, names, regions)


def _checkpoint(model: torch.nn.Module, checkpoint: str | Mapping[str, str]) -> list:
    if checkpoint == "none" or not checkpoint:
        return []
    blocks = apply_checkpointing(model, None if checkpoint == "full" else checkpoint)
    if not blocks:  # "full" on a model without repeated blocks
        raise GobrrrError(
            "--checkpoint full found no repeated blocks (an nn.ModuleList of "
            "modules of one class) to checkpoint in this model"
        )
    return blocks


def _in_forward_order(names: list[str], graph: StepGraph) -> list[str]:
    """The repeated blocks in the order the forward first runs them (blocks it never runs
    last, in the model's order)."""
    first: dict[str, int] = {}
    for n in graph.nodes:
        if n.phase == "forward":
            parts = n.module.split(".")
            for k in range(1, len(parts) + 1):
                first.setdefault(".".join(parts[:k]), n.index)
    never = len(graph.nodes)
    return sorted(names, key=lambda b: first.get(b, never))


def _trace(
    w: Workload,
    precision: Precision,
    values: assume.Values,
    on_step: Callable[[], None] = lambda: None,
    accumulation: int = 1,
    regions: compiled.Regions | None = None,
    whole: bool = True,
) -> StepGraph:
    names = {id(p): n for n, p in w.model.named_parameters(remove_duplicate=False)}
    with torch.enable_grad(), _capturable_traced():
        step = _Step(w, precision, accumulation=accumulation)
        values.during("warm-up")
        _guarded(step.init_optimizer_state, "optimizer's first step")
        on_step()
        table = StorageTable()
        _register_state(table, w, step.optimizer)
        with _module_hooks(driver := _Driver(w.model)):
            step.driver = driver
            if regions is not None:  # under the hooks and modes: dynamo guards on them
                with assume.HostMode(values):
                    runner = _compiled_warm_up(step, w, regions, whole)
                    driver.names[id(runner)] = ""
            saved = SavedTracker(table)
            rec = step.recorder = Recorder(
                table, driver.module, driver.current_phase, on_op=saved.on_op
            )
            driver.on_output = rec.mark_output
            values.where = lambda: (driver.module(), driver.current_phase(), len(rec.nodes))
            if regions is not None:
                regions.clock = lambda: len(rec.nodes)

            def grab_grads(opt, args, kwargs):  # grads exist only between backward and step
                _mark_grads(table, w, names)

            hooks = [
                step.optimizer.register_step_pre_hook(grab_grads),
                *([] if regions is not None else saved.watch_blocks(w.model, block_names(w.model))),
            ]
            try:
                with rec, assume.HostMode(values):
                    _guarded(step, "traced step", rec)
            finally:
                for h in hooks:
                    h.remove()
        table.clock = len(rec.nodes) - 1
        table.close()
    in_place = accumulate.in_place(table.records, rec.nodes, rec.engine_sums)
    _classify(table, rec.nodes)
    graph = _assemble(rec, table, w, precision)
    return dataclasses.replace(
        graph,
        nodes=saved.counted(graph.nodes),
        meta=graph.meta.replace(
            syncs=tuple(step.syncs),
            autograd=saved.meta(),
            gradient_sums_in_place=in_place,
            optimizer=_optimizer_meta(step.optimizer),
            loop="forward-backward" if w.forward_backward is not None else "drops-output",
            outputs=tuple(rec.outputs),
        ),
    )


def _compiled_warm_up(
    step: _Step, w: Workload, regions: compiled.Regions, whole: bool = True
) -> torch.nn.Module:
    """The step's model under torch.compile as the trace runs it (`compiled.compile_model`;
    `whole` False: its blocks were compiled in place, `compiled.compile_blocks`), compiled
    and run once, unrecorded (forward and backward of one micro-batch, its gradients
    dropped): the recorded step is a steady-state one, as measured steps are."""
    runner = compiled.compile_model(w.model, regions) if whole else w.model
    step.workload = dataclasses.replace(w, model=runner)
    first = split_batch(w.batch, step.accumulation)[0]
    if w.forward_backward is not None:
        _guarded(lambda: step.forward_backward(first), "compiled model's first step")
    else:
        _guarded(lambda: step.backward(step.forward(first)), "compiled model's first step")
    for p in w.model.parameters():
        p.grad = None
    regions.runs.clear()
    return runner


def _assemble(rec: Recorder, table: StorageTable, w: Workload, precision: Precision) -> StepGraph:
    frees: dict[int, list[int]] = {}
    for r in table.records:
        if r.freed is not None and r.freed >= 0:
            frees.setdefault(r.freed, []).append(r.id)
    nodes = tuple(dataclasses.replace(n, frees=tuple(frees.get(n.index, ()))) for n in rec.nodes)
    params = list(w.model.parameters())
    packed = bnb.elements(w.model)  # a 4-bit weight: two elements a byte
    n_params = sum(packed.get(id(p), p.numel()) for p in params)
    meta = StepMeta(
        name=w.name,
        precision=precision,
        tokens=w.token_count(),
        seq_len=w.seq_len,
        params=n_params,
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        embedding_params=embedding_only_params(w.model),
        info=dict(w.info),
        traced_on="cpu-fake",
        torch=torch.__version__,
        # read after the user's workload ran: it may set them
        tf32=Tf32(
            matmul=precision.tf32 or torch.backends.cuda.matmul.allow_tf32,
            conv=precision.tf32 or torch.backends.cudnn.allow_tf32,
        ),
    )
    return StepGraph(nodes=nodes, storages=table.infos(), meta=meta)


@contextlib.contextmanager
def _capturable_traced() -> Iterator[None]:
    """An optimizer made capturable (`capturable=True`: its step counts and bias corrections
    on the device, as a CUDA graph needs them; `gobrrr.apply` sets it for a captured step)
    traced on the fake CPU tensors that stand for the GPU's: torch's optimizers check that
    such tensors are on a device they can capture on, which the trace's stand-ins are not, so
    the trace's device type is added to that list while tracing. The ops recorded are those
    the optimizer runs on a GPU; an optimizer that is not capturable is not affected."""
    import torch.optim.optimizer as base

    orig = base._get_capturable_supported_devices

    def supported(supports_xla: bool = True) -> list[str]:
        return [*orig(supports_xla), "cpu"]

    # every torch.optim module that imported the check by name (adam, rmsprop, ...)
    mods = [
        m
        for name, m in list(sys.modules.items())
        if (name == "torch.optim" or name.startswith("torch.optim."))
        and isinstance(m, types.ModuleType)
        and getattr(m, "_get_capturable_supported_devices", None) is orig
    ]
    for m in mods:
        m._get_capturable_supported_devices = supported
    try:
        yield
    finally:
        for m in mods:
            m._get_capturable_supported_devices = orig


def _guarded(fn: Callable[[], None], what: str, rec: Recorder | None = None) -> None:
    """Run the user's step; turn what it raises into one clear line."""
    try:
        fn()
    except GobrrrError:
        raise
    except torch._subclasses.fake_tensor.UnsupportedFakeTensorException as e:
        raise GobrrrError(f"the {what} used an op fake tensors cannot run{_where(rec)}: {e}") from e
    except (
        torch._subclasses.fake_tensor.DynamicOutputShapeException,
        torch._subclasses.fake_tensor.DataDependentOutputException,
    ) as e:
        raise GobrrrError(
            f"the {what} used a data-dependent op ({e}){_where(rec)}: its output shape depends on "
            "tensor values, which a fake-tensor trace does not have; rewrite it with static "
            "shapes (e.g. masking instead of boolean indexing)"
        ) from e
    except Exception as e:
        raise GobrrrError(f"the {what} raised {type(e).__name__}{_where(rec)}: {e}") from e


def _where(rec: Recorder | None) -> str:
    if rec is None or not rec.nodes:
        return ""
    last = rec.nodes[-1]
    return f" (after op {last.op} in module '{last.module or '<top>'}', phase {last.phase})"
