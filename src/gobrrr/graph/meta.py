"""What a step graph's trace was, and what the passes did to it: `StepMeta`, typed.

The capture writes it (`gobrrr.capture`: the workload, its counts, the host syncs, what
autograd saved, the optimizer; `capture.compiled`: the compiled regions); each pass returns a
new one through the methods here, which keep the op indices it holds (`syncs`,
`compiled_regions`, `repeat`) consistent with the ops it moved and append itself to
`passes`. In JSON it is the flat object of today's files (`to_dict` / `from_dict`): a field
that is None is a key the file does not have; keys this version does not know are kept in
`extra` and written back as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gobrrr.errors import GobrrrError
from gobrrr.precision import DEFAULT, Precision

AUTOGRAD_VERSION = 1


@dataclass(frozen=True)
class Tf32:
    """Which fp32 work runs on TF32 tensor cores. PyTorch's defaults: matmuls no
    (`torch.backends.cuda.matmul.allow_tf32` False), cuDNN convolutions yes
    (`torch.backends.cudnn.allow_tf32` True)."""

    matmul: bool = False
    conv: bool = True


class SavedRow(NamedTuple):
    """One tensor an autograd node saved: the forward op `op`, the storage it saved, whether
    the save happens after the op ran (one of its outputs) or before (an input), whether the
    saved tensor requires grad, and the saved view (shape and stride in elements, dtype,
    offset in elements)."""

    op: int
    storage: int
    after: bool
    requires_grad: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    offset: int


class NodeSpan(NamedTuple):
    """The forward op whose autograd node saved tensors, and the first and last op its
    backward ran (first = last + 1: it ran no op). Autograd unpacks what the node saved
    before its first op and lets go of it after its last."""

    op: int
    first: int
    last: int


class Unreferenced(NamedTuple):
    """A saved storage, and the forward op after which no Python reference to it was left
    (saved ones only: what checkpointing frees)."""

    storage: int
    op: int


@dataclass(frozen=True)
class Autograd:
    """What autograd did in the traced step (`gobrrr.capture.saved.SavedTracker`): the input
    of the checkpoint pass, which drops it from the graph it returns.

    version: AUTOGRAD_VERSION of the tracker that wrote it.
    hooked: the forward packed saved tensors through saved-tensor hooks.
    saved: every tensor the autograd nodes alive when backward starts saved.
    node_spans: the backward ops each such node ran, sorted.
    unreferenced: when Python let go of each saved storage.
    block_inputs: {block name: the storages of the tensors passed to its call}. A
        checkpointed block keeps its arguments until its last node in backward is done.
    """

    version: int = AUTOGRAD_VERSION
    hooked: bool = False
    saved: tuple[SavedRow, ...] = ()
    node_spans: tuple[NodeSpan, ...] = ()
    unreferenced: tuple[Unreferenced, ...] = ()
    block_inputs: Mapping[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Autograd:
        return Autograd(
            version=d.get("version", 0),
            hooked=bool(d.get("hooked", False)),
            saved=tuple(_saved_row(*r) for r in d.get("saved", ())),
            node_spans=tuple(NodeSpan(*r) for r in d.get("node_spans", ())),
            unreferenced=tuple(Unreferenced(*r) for r in d.get("unreferenced", ())),
            block_inputs=dict(d.get("block_inputs", {})),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "hooked": self.hooked,
            "saved": [[*r[:4], list(r.shape), list(r.stride), *r[6:]] for r in self.saved],
            "node_spans": [list(r) for r in self.node_spans],
            "unreferenced": [list(r) for r in self.unreferenced],
            "block_inputs": dict(self.block_inputs),
        }


def _saved_row(op, storage, after, requires_grad, shape, stride, dtype, offset) -> SavedRow:
    return SavedRow(op, storage, after, requires_grad, tuple(shape), tuple(stride), dtype, offset)


@dataclass(frozen=True)
class OptimizerInfo:
    """The optimizer as the time model looks its host cost up (`Calibration.optimizer_host`).

    key: its class and implementation (`gobrrr.training.optimizers.optimizer_key`).
    tensors: parameter tensors it steps.
    large: of those, how many hold more than LARGE_TENSOR_BYTES.
    """

    key: str
    tensors: int
    large: int


class Region(NamedTuple):
    """One run of a compiled graph: its kind ("forward", "backward", "inference") and the
    first and last op index it recorded."""

    kind: str
    first: int
    last: int


class Repeat(NamedTuple):
    """nodes[start:end] stand for `times` identical runs of themselves (the later
    micro-batches of an accumulated step)."""

    start: int
    end: int
    times: int


class Captured(NamedTuple):
    """nodes[start:] run as `graphs` captured CUDA graphs, replayed (`passes.cudagraph`): the
    host launches each graph once instead of issuing those ops one by one."""

    start: int
    graphs: int


class ModelOutput(NamedTuple):
    """One tensor the model's forward returned (`gobrrr.capture.recorder.Recorder.outputs`):
    `returned`, the op after which that forward call returned; the storage it lives in; where
    it sits in what the call returned (e.g. "logits", "[0]", "past_key_values.layers[0].keys");
    its shape and dtype; whether it was reached through tuples, lists and dicts alone (False:
    an object's attribute lies on the way, as for an HF KV cache's tensors). A training loop
    that keeps the output (`out = model(...)` alive until the next step rebinds it) keeps
    these storages; Accelerate's mixed precision copies the `contained` fp16/bf16 ones to
    fp32 (`gobrrr.passes.loop`)."""

    returned: int
    storage: int
    path: str
    shape: tuple[int, ...]
    dtype: str
    contained: bool = True


#: The training loops a step graph can assume (`gobrrr.passes.loop`): "drops-output", the
#: model's output freed before backward (gobrrr's TrainStep, Lightning, HF Trainer in fp32);
#: "keeps-output", `out = model(...)` held until the next step rebinds it (the plain loop,
#: timm's and torchvision's reference scripts); "hf-trainer", dropped too, after Accelerate's
#: mixed precision copied its fp16/bf16 tensors to fp32; "forward-backward", the user's own
#: `Workload(forward_backward=...)`, traced as it holds its tensors.
LOOPS = ("drops-output", "keeps-output", "zero-grad-first", "hf-trainer", "forward-backward")


#: Fields whose JSON form is not the value itself: (to JSON, from JSON).
@dataclass(frozen=True)
class Parallel:
    """How the step runs over several GPUs: the data-parallel recipe a shard pass applied.

    kind: "ddp" (every rank holds the whole model; gradients all-reduced in buckets during
        backward) or "fsdp" (FSDP2's fully_shard: parameters, gradients and optimizer states
        sharded over the ranks; each unit's parameters all-gathered around its use).
    world: data-parallel ranks (GPUs) in all.
    hosts: hosts they span (world / hosts GPUs on each, linked by NVLink within a host).
    """

    kind: str
    world: int
    hosts: int = 1

    @property
    def per_host(self) -> int:
        return self.world // self.hosts


_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "precision": (str, Precision.parse),
    "tf32": (
        dataclasses.asdict,
        lambda d: Tf32(bool(d.get("matmul", False)), bool(d.get("conv", True))),
    ),
    "syncs": (list, tuple),
    "parallel": (dataclasses.asdict, lambda d: Parallel(**d)),
    "autograd": (Autograd.to_dict, Autograd.from_dict),
    "optimizer": (dataclasses.asdict, lambda d: OptimizerInfo(**d)),
    "blocks": (list, tuple),
    "assumptions": (list, tuple),
    "compiled_regions": (
        lambda rs: [list(r) for r in rs],
        lambda rs: tuple(Region(*r) for r in rs),
    ),
    "repeat": (
        lambda r: r._asdict(),
        lambda d: Repeat(int(d["start"]), int(d["end"]), int(d["times"])),
    ),
    "passes": (list, tuple),
    "cuda_graph": (lambda c: c._asdict(), lambda d: Captured(int(d["start"]), int(d["graphs"]))),
    "outputs": (
        lambda os: [
            [*o[:3], list(o.shape), o.dtype, *([] if o.contained else [False])] for o in os
        ],
        lambda os: tuple(ModelOutput(a, b, c, tuple(d), e, *rest) for a, b, c, d, e, *rest in os),
    ),
}
#: Fields written even when None (the file holds null).
_ALWAYS = frozenset({"seq_len"})


@dataclass(frozen=True)
class StepMeta:
    """What a step graph's trace was and what the passes did to it. A field that is None is
    one the trace or the passes did not record (a key absent from the JSON)."""

    name: str = ""
    """The workload's name (a model in the registry, or the user's)."""
    precision: Precision = DEFAULT
    """The precision the step was traced in (JSON: its string, e.g. "bf16-mixed")."""
    tokens: int = 0
    """Samples' tokens per optimizer step (sequence models; samples otherwise): all
    micro-batches of an accumulated step."""
    seq_len: int | None = None
    """Tokens per sample; None for a model without a sequence."""
    params: int = 0
    """Parameter elements of the model (tied ones once)."""
    trainable_params: int = 0
    """Of those, elements that require grad."""
    embedding_params: int = 0
    """Elements of parameters only embedding lookups read (left out of 6N FLOPs)."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """The workload's own facts (`Workload.info`: e.g. layers, heads, hidden size)."""
    traced_on: str | None = None
    """Where the ops were traced ("cpu-fake": fake tensors on the CPU)."""
    torch: str | None = None
    """The torch version that traced it."""
    tf32: Tf32 | None = None
    """The TF32 settings recorded after the workload ran (None: traced before they were;
    `tf32_mode` is what applies)."""
    syncs: tuple[int, ...] | None = None
    """Op indices after which the host waits for the GPU (an .item(), a found-inf check),
    sorted."""
    autograd: Autograd | None = None
    """What autograd saved for backward (None once the checkpoint pass has used it)."""
    gradient_sums_in_place: int | None = None
    """Gradient sums (a parameter used twice) autograd accumulated in place."""
    optimizer: OptimizerInfo | None = None
    """The optimizer, as its host cost is looked up."""
    checkpoint: str | Mapping[str, str] | None = None
    """The step's checkpointing: "none", "full" (every repeated block) or {block: policy}
    (`gobrrr.training.checkpointing.checkpoint_meta`)."""
    checkpointed_blocks: int | None = None
    """Blocks the step checkpoints."""
    blocks: tuple[str, ...] | None = None
    """The model's repeated blocks, in the order the forward first runs them."""
    sdpa_backends: Mapping[str, int] | None = None
    """{attention backend: calls} of F.scaled_dot_product_attention in the step."""
    assumptions: tuple[dict[str, Any], ...] | None = None
    """Values the trace could not know and assumed (`gobrrr.capture.assume.Assumption`
    dicts)."""
    compiled: bool | None = None
    """True: the model ran under torch.compile (`capture(compile=True)`)."""
    compiled_regions: tuple[Region, ...] | None = None
    """The compiled graphs' runs, in op indices."""
    compiled_graphs: Mapping[str, int] | None = None
    """{kind: graphs AOTAutograd made} (several forwards: graph breaks)."""
    inductor: Mapping[str, int] | None = None
    """What the Inductor memory pass did (`gobrrr.passes.compile.inductor`): storages and
    bytes it left unallocated, buffers written in place, reused, padded."""
    accumulation: int | None = None
    """Micro-batches per optimizer step, where `passes.accumulate` made them."""
    repeat: Repeat | None = None
    """Nodes standing for several identical runs (`StepGraph.repeat`)."""
    micro_batch: int | None = None
    """The micro-batch a `passes.microbatch` family gave this graph at."""
    passes: tuple[dict[str, Any], ...] | None = None
    """The passes applied, in order: {"pass": name, its arguments...}."""
    loop: str | None = None
    """The training loop the graph's memory assumes (one of LOOPS; None: a graph from before
    loops were recorded, which is gobrrr's TrainStep: "drops-output")."""
    outputs: tuple[ModelOutput, ...] | None = None
    """The tensors the model's forward returned, each call's (the capture marks them)."""
    parallel: Parallel | None = None
    """The data-parallel recipe a shard pass applied (`passes.ddp`, `passes.fsdp`); None: one
    GPU. The graph is then one rank's step."""
    cuda_graph: Captured | None = None
    """The ops replayed as captured CUDA graphs (`passes.cudagraph`); None: issued eagerly."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys of a file this version does not know, kept to be written back."""

    # -- reading ----------------------------------------------------------------------------
    @property
    def tf32_mode(self) -> Tf32:
        """The TF32 settings the step ran under: both on for precision "tf32", else those
        recorded, PyTorch's defaults for graphs traced before they were recorded."""
        if self.precision.tf32:
            return Tf32(True, True)
        return self.tf32 or Tf32()

    @property
    def loop_mode(self) -> str:
        """`loop`, "drops-output" (gobrrr's TrainStep, what capture traces) where not
        recorded."""
        return self.loop or "drops-output"

    @property
    def checkpoint_mode(self) -> str | Mapping[str, str]:
        """`checkpoint`, "none" where not recorded."""
        return "none" if self.checkpoint is None else self.checkpoint

    # -- changing (each returns a new StepMeta) ---------------------------------------------
    def with_pass(self, record: Mapping[str, Any], **changes: Any) -> StepMeta:
        """This meta with `changes` made and `record` ({"pass": name, ...}) appended to
        `passes`."""
        return dataclasses.replace(self, **changes, passes=(*(self.passes or ()), dict(record)))

    def with_ops_moved(self, at: Callable[[int], int], new_syncs: Iterable[int] = ()) -> StepMeta:
        """This meta after a pass renumbered the ops: every op index it holds (syncs,
        compiled regions) goes to `at(index)`; `new_syncs` (new indices) join the syncs."""
        syncs = (
            None
            if self.syncs is None and not new_syncs
            else tuple(sorted([at(i) for i in self.syncs or ()] + list(new_syncs)))
        )
        regions = (
            None
            if self.compiled_regions is None
            else tuple(Region(k, at(a), at(b)) for k, a, b in self.compiled_regions)
        )
        outputs = (
            None
            if self.outputs is None
            else tuple(o._replace(returned=at(o.returned)) for o in self.outputs)
        )
        return dataclasses.replace(self, syncs=syncs, compiled_regions=regions, outputs=outputs)

    def with_repeated(self, split: int, shift: int, pos: Mapping[int, int], n: int) -> StepMeta:
        """This meta after `passes.accumulate` inserted the second micro-batch's `shift` ops
        at `split` (`pos`: an op of the first micro-batch -> the same op in the second),
        standing for n - 1 runs: syncs and compiled regions of the first micro-batch are
        repeated there, those after it shifted; tokens multiplied by n."""
        syncs = self.syncs or ()
        # A sync of the first micro-batch is repeated `shift` ops later, not at pos[i]: the
        # two differ by the gradient sums inserted after it (kept as the model was fitted).
        moved = {*(i for i in syncs if i < split), *(i + shift for i in syncs)}
        regions = self.compiled_regions
        if regions:  # micro-batch 2 runs the same compiled graphs
            regions = (*regions, *(Region(k, pos[a], pos[b]) for k, a, b in regions if b < split))
        return self.with_pass(
            {"pass": "accumulate", "n": n},
            accumulation=n,
            repeat=Repeat(split, split + shift, n - 1),
            tokens=int(self.tokens or 0) * n,
            syncs=tuple(sorted(moved)),
            compiled_regions=regions,
        )

    def replace(self, **changes: Any) -> StepMeta:
        """This meta with `changes` made (field names as above)."""
        return dataclasses.replace(self, **changes)

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON object of today's files: every field that is not None under its name,
        then the unknown keys a file held."""
        out: dict[str, Any] = {}
        for f in _FIELDS:
            v = getattr(self, f)
            if v is None and f not in _ALWAYS:
                continue
            out[f] = _CODECS[f][0](v) if v is not None and f in _CODECS else _plain(v)
        out.update(self.extra)
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> StepMeta:
        """The meta of a JSON object (`to_dict`'s form); unknown keys go to `extra`."""
        if not isinstance(d, Mapping):
            raise GobrrrError(f"step graph meta must be a JSON object, got {type(d).__name__}")
        known = {
            k: (_CODECS[k][1](v) if v is not None and k in _CODECS else v)
            for k, v in d.items()
            if k in _FIELDS
        }
        return StepMeta(**known, extra={k: v for k, v in d.items() if k not in _FIELDS})


def _plain(v: Any) -> Any:
    """A mapping field as a plain dict (JSON and equality with a loaded copy)."""
    return dict(v) if isinstance(v, Mapping) else v


_FIELDS = tuple(f.name for f in dataclasses.fields(StepMeta) if f.name != "extra")
