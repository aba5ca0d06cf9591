"""The training loop as a graph pass: how long the model's output lives.

gobrrr traces its own step (`gobrrr.training.step.TrainStep`), which, like HF's
`Trainer.training_step` and Lightning, drops what the model returned as soon as the loss is
taken from it: the output's tensors live only as long as backward needs them. The loop most
people write keeps it:

    for batch in loader:
        out = model(**batch)           # the previous `out` is let go only here, once the
        loss = out.loss                # new forward has returned
        loss.backward()
        opt.step(); opt.zero_grad()

so `out` (the logits, an HF model's KV cache, whatever the forward returned) stays alive
through backward and the optimizer step, and into the next step until its forward returns
(timm's and torchvision's reference train_one_epoch hold `output` the same way). The capture
marks what each call of the model's forward returned (`StepMeta.outputs`); `loop(graph,
"keeps-output")` holds those storages as that loop does:

- the output of micro-batch k lives until micro-batch k + 1's forward has returned; the
  last micro-batch's until the end of the step;
- the previous step's output (the same storages) is alive from the step's first op until
  its first forward returns: a storage allocated by op 0 and freed there, `carried`: the
  process's first step has no previous step, and the memory replay leaves it out there
  (where the first step's segments are mapped).

"zero-grad-first" is timm's and torchvision's train_one_epoch: the output kept as above, and
`optimizer.zero_grad()` called after the loss, just before backward, so last step's gradients
(one storage per gradient the step makes) are alive from op 0 until the forward's last op.

"hf-trainer" is HF's `Trainer.training_step` (transformers 5.17, accelerate 1.15): it drops the
output as gobrrr's step does, but under mixed precision the Accelerator that prepared the model
wrapped its forward in `convert_outputs_to_fp32` (accelerate/accelerator.py, prepare_model),
so what the forward returned goes through `convert_to_fp32` (accelerate/utils/operations.py),
a `.float()` copy of each fp16/bf16 tensor it reaches through tuples, lists and dicts (HF's
ModelOutput is a dict; an HF Cache is not entered). The pass inserts those copies
(`aten._to_copy` to fp32) after each forward call returns: the originals live until the last
copy is made (the wrapper's argument), the copies until the loss is taken (compute_loss
returns `outputs["loss"]` and lets the outputs go), both before backward starts. For an MLM
head (bf16 logits, its loss in fp32 inside the model) this is the step's peak: the forward's
saved tensors, the bf16 logits and their fp32 copy at once. In fp32 there is nothing to copy
and it is "drops-output". The Trainer also sets `model.config.use_cache` to
`TrainingArguments.use_cache` (False) when it is made, so a decoder returns no KV cache under
it: `gobrrr.estimate(loop="hf-trainer")` traces the model so configured (a change to the model
before the trace, not to the graph; under torch.compile it takes away Inductor's contiguous
copies of every layer's keys and values, 302 MB for GPT-2 at batch 8 x 1024).

Checked against the real loops on the CPU, live bytes counted op by op (tests/test_loop.py):
a tiny HF Llama (its logits, KV cache and loss), a BERT MLM and a small net hold exactly
what these loops predict.

Only lifetimes change (and those storages are added): the ops, and so the time, are the
graph's own, but for "hf-trainer"'s copies. "drops-output" is the graph as traced. A
`Workload(forward_backward=...)` graph ("forward-backward") is the user's own loop, traced as
it holds its tensors: no pass applies.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo
from gobrrr.graph.meta import ModelOutput, StepMeta

#: the loops `loop` (and `gobrrr.estimate(loop=...)`) take
LOOPS = ("drops-output", "keeps-output", "zero-grad-first", "hf-trainer")
#: what each loop is, in words (reports)
DESCRIBED = {
    "drops-output": "drops the model's output before backward (gobrrr's own step, "
    "Lightning, HF Trainer in fp32)",
    "keeps-output": "keeps the model's output alive until the next step "
    "(out = model(batch); loss.backward(); opt.step())",
    "zero-grad-first": "keeps the model's output and calls zero_grad() just before backward, "
    "so last step's gradients live through the forward (timm's and torchvision's "
    "train_one_epoch)",
    "hf-trainer": "drops the model's output before backward after Accelerate copied its "
    "fp16/bf16 tensors to fp32, the model's KV cache off (HF Trainer: an Accelerate-prepared "
    "model, config.use_cache False)",
    "forward-backward": "is the workload's own forward_backward, traced as it holds its tensors",
}
#: the dtypes Accelerate's `convert_to_fp32` copies
LOW_PRECISION = ("float16", "bfloat16")


def other(kind: str) -> str | None:
    """The loop `kind` is compared with (None for the user's own forward_backward)."""
    return {
        "drops-output": "keeps-output",
        "keeps-output": "drops-output",
        "zero-grad-first": "drops-output",
        "hf-trainer": "keeps-output",
    }.get(kind)


def loop(graph: StepGraph, kind: str) -> StepGraph:
    """`graph` (as traced: gobrrr's step, "drops-output") with the model's output held as
    loop `kind` holds it (see the module docstring). The graph itself where it already is
    that loop."""
    if kind not in LOOPS:
        raise GobrrrError(f"unknown loop {kind!r}: choose one of {', '.join(LOOPS)}")
    current = graph.meta.loop_mode
    if current == "forward-backward":
        raise GobrrrError(
            f"--loop {kind}: this workload gives its own forward_backward, whose loop is "
            "traced as it runs: leave --loop out"
        )
    if kind == current:
        return graph
    if current != "drops-output":
        raise GobrrrError(f"loop {kind!r} on a {current!r} graph: apply it to the traced graph")
    if graph.repeat is not None:
        raise GobrrrError(f"loop {kind!r} on an accumulated graph: apply it before `accumulate`")
    if kind == "hf-trainer":
        return fp32_copies(graph)
    kept = _keeps(graph, kind)
    return _previous_gradients(kept) if kind == "zero-grad-first" else kept


def _keeps(graph: StepGraph, kind: str = "keeps-output") -> StepGraph:
    last = len(graph.nodes) - 1
    calls = _calls(graph)
    returns = sorted(calls)
    if not returns:  # nothing marked: the loop changes nothing
        meta = graph.meta.with_pass({"pass": "loop", "loop": kind}, loop=kind)
        return dataclasses.replace(graph, meta=meta)
    storages = list(graph.storages)
    frees: dict[int, set[int]] = defaultdict(set)  # op -> storages it frees, changes only
    unfree: dict[int, set[int]] = defaultdict(set)
    for k, at in enumerate(returns):
        until = returns[k + 1] if k + 1 < len(returns) else last
        for sid in calls[at]:
            s = storages[sid]
            if s.freed < until:
                unfree[s.freed].add(sid)
                frees[until].add(sid)
                storages[sid] = dataclasses.replace(s, freed=until)
    paths = {o.storage: o.path for o in graph.meta.outputs or ()}
    previous = []
    for sid in calls[returns[-1]]:  # the previous step's output, until the first forward returns
        s, new = storages[sid], len(storages)
        label = f"previous step's {paths[sid]}"
        storages.append(
            StorageInfo(new, s.nbytes, s.kind, 0, returns[0], label, s.module, carried=True)
        )
        previous.append(new)
    frees[returns[0]].update(previous)
    nodes = list(graph.nodes)
    for i in sorted({*frees, *unfree}):
        n = nodes[i]
        kept = tuple(f for f in n.frees if f not in unfree.get(i, ()))
        nodes[i] = dataclasses.replace(n, frees=kept + tuple(sorted(frees.get(i, ()))))
    nodes[0] = dataclasses.replace(nodes[0], allocs=nodes[0].allocs + tuple(previous))
    meta = graph.meta.with_pass({"pass": "loop", "loop": kind}, loop=kind)
    return StepGraph(nodes=tuple(nodes), storages=tuple(storages), meta=meta)


def fp32_copies(graph: StepGraph) -> StepGraph:
    """`graph` as Accelerate's mixed-precision wrapper runs it ("hf-trainer", see the module
    docstring): after each forward call returns, one `_to_copy` to fp32 per fp16/bf16 tensor
    it returned in tuples, lists and dicts. The originals the step frees as the call returns
    live until the last copy is made; the copies die there too (the loss is taken and the
    outputs let go before backward)."""
    calls: dict[int, list[ModelOutput]] = defaultdict(list)
    for o in graph.meta.outputs or ():
        if o.contained and o.dtype in LOW_PRECISION:
            calls[o.returned].append(o)
    meta = graph.meta.with_pass({"pass": "loop", "loop": "hf-trainer"}, loop="hf-trainer")
    if not calls:  # fp32, or nothing returned: the wrapper copies nothing
        return dataclasses.replace(graph, meta=meta)

    def at(i: int) -> int:  # an op's index once the copies are in
        return i + sum(len(os_) for r, os_ in calls.items() if r < i) if i >= 0 else i

    storages = [
        dataclasses.replace(
            s, created=at(s.created), freed=None if s.freed is None else at(s.freed)
        )
        for s in graph.storages
    ]
    nodes = [dataclasses.replace(n, index=at(n.index)) for n in graph.nodes]
    for r in sorted(calls, reverse=True):  # from the end, so earlier positions hold
        nodes[at(r)], copies = _copies(nodes[at(r)], calls[r], storages)
        nodes[at(r) + 1 : at(r) + 1] = copies
    meta = _moved(meta.with_ops_moved(at), at)
    return StepGraph(nodes=tuple(nodes), storages=tuple(storages), meta=meta)


def _copies(
    returned: OpNode, outs: list[ModelOutput], storages: list[StorageInfo]
) -> tuple[OpNode, list[OpNode]]:
    """(`returned`, the `.float()` of each of `outs` after it): new fp32 storages, appended to
    `storages` (renumbered already), alive until the last copy, which also frees the
    originals `returned` freed."""
    first, last = returned.index + 1, returned.index + len(outs)
    originals = {o.storage for o in outs}
    held = tuple(f for f in returned.frees if f in originals)
    kept = tuple(f for f in returned.frees if f not in originals)
    copies = []
    for k, o in enumerate(outs):
        new = len(storages)
        view = TensorInfo(o.shape, _contiguous(o.shape), o.dtype, o.storage)
        label = f"fp32 copy of the output's {o.path} (Accelerate)"
        storages.append(StorageInfo(new, 4 * view.numel, "temporary", first + k, last, label))
        out = TensorInfo(o.shape, _contiguous(o.shape), "float32", new)
        copies.append(
            OpNode(
                first + k,
                "aten._to_copy.default",
                "forward",
                "",
                (view,),
                (out,),
                args=({"t": 0},),
                kwargs={"dtype": "torch.float32"},
                allocs=(new,),
            )
        )
    for f in held:
        storages[f] = dataclasses.replace(storages[f], freed=last)
    made = tuple(c.allocs[0] for c in copies)
    copies[-1] = dataclasses.replace(copies[-1], frees=held + made)
    return dataclasses.replace(returned, frees=kept), copies


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides (elements) of `shape`."""
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= max(n, 1)
    return tuple(reversed(out))


def _moved(meta: StepMeta, at: Callable[[int], int]) -> StepMeta:
    """The op indices `with_ops_moved` leaves to the pass: autograd's record and a CUDA
    graph's start."""
    if meta.cuda_graph is not None:
        meta = meta.replace(cuda_graph=meta.cuda_graph._replace(start=at(meta.cuda_graph.start)))
    a = meta.autograd
    if a is None:
        return meta
    a = dataclasses.replace(
        a,
        saved=tuple(r._replace(op=at(r.op)) for r in a.saved),
        node_spans=tuple(
            x._replace(op=at(x.op), first=at(x.first), last=at(x.last)) for x in a.node_spans
        ),
        unreferenced=tuple(u._replace(op=at(u.op)) for u in a.unreferenced),
    )
    return meta.replace(autograd=a)


def _previous_gradients(graph: StepGraph) -> StepGraph:
    """`graph` with last step's gradients alive from its first op until `zero_grad()` frees
    them just before backward (after the last forward op): one storage per gradient the
    step makes and frees (a gradient the step keeps is alive at its start already)."""
    phases = [n.phase for n in graph.nodes]
    if "backward" not in phases or phases.index("backward") == 0:
        return graph
    until = phases.index("backward") - 1
    storages = list(graph.storages)
    previous = []
    for s in graph.storages:
        if s.kind == "gradient" and s.created >= 0 and s.freed is not None and s.nbytes > 0:
            new = len(storages)
            label = f"previous step's gradient {s.label}".rstrip()
            storages.append(
                StorageInfo(new, s.nbytes, s.kind, 0, until, label, s.module, carried=True)
            )
            previous.append(new)
    if not previous:
        return graph
    nodes = list(graph.nodes)
    nodes[0] = dataclasses.replace(nodes[0], allocs=nodes[0].allocs + tuple(previous))
    nodes[until] = dataclasses.replace(nodes[until], frees=nodes[until].frees + tuple(previous))
    return dataclasses.replace(graph, nodes=tuple(nodes), storages=tuple(storages))


def _calls(graph: StepGraph) -> dict[int, list[int]]:
    """{op after which a forward call returned: the storages of its output that the step
    made and frees (those made before it, or kept past it, a loop cannot change)}."""
    out: dict[int, list[int]] = defaultdict(list)
    for o in graph.meta.outputs or ():
        s = graph.storages[o.storage]
        if s.created >= 0 and s.freed is not None and s.nbytes > 0:
            out[o.returned].append(o.storage)
    return dict(out)


def held(graph: StepGraph) -> list[ModelOutput]:
    """The model's outputs a keeping loop holds longer than gobrrr's step: each call's
    tensors in storages the step makes and frees."""
    calls = _calls(graph)
    seen: set[int] = set()
    out = []
    for o in graph.meta.outputs or ():
        if o.storage in calls.get(o.returned, ()) and o.storage not in seen:
            seen.add(o.storage)
            out.append(o)
    return out


def described(outputs: list[ModelOutput], sizes: dict[int, int], most: int = 3) -> str:
    """What `outputs` are, in words, largest first, grouped by the first name of their path:
    "the logits (bf16 [4, 2048, 128256])", "past_key_values (32 tensors, 256 MiB)".
    `sizes`: bytes by storage id."""
    groups: dict[str, list[ModelOutput]] = defaultdict(list)
    for o in outputs:
        groups[o.path.split(".")[0].split("[")[0] or "output"].append(o)
    ranked = sorted(groups.items(), key=lambda kv: -sum(sizes.get(o.storage, 0) for o in kv[1]))
    words = []
    for name, os_ in ranked[:most]:
        if len(os_) == 1:
            o = os_[0]
            words.append(f"the {name} ({o.dtype} {list(o.shape)})")
        else:
            mib = sum(sizes.get(o.storage, 0) for o in os_) / 2**20
            words.append(f"the {name} ({len(os_)} tensors, {mib:,.0f} MiB)")
    rest = len(ranked) - most
    return ", ".join(words) + (f" and {rest} more" if rest > 0 else "")
