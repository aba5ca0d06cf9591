"""The checkpoint pass: the step with some blocks activation-checkpointed, from a graph traced
without checkpointing, without tracing again.

    g2 = checkpoint(graph, {"transformer.h.0": "full", "transformer.h.1": "selective"})

It reproduces what torch.utils.checkpoint (non-reentrant) and `gobrrr.training.checkpointing.
apply_checkpointing` do, op for op:
- forward: the same ops; a checkpointed block keeps none of the tensors its autograd nodes
  save (they die when the code lets go of them) except, under "selective", the outputs of
  SELECTIVE_SAVE ops, which a detach after each such op hands to the checkpoint's cache;
  the block's inputs stay alive until its last node in backward is done.
- backward: when backward first unpacks a block's saved tensor, the block's forward runs
  again (phase "recompute"; ops the block runs itself, outside any child module, show as
  "backward" in the module backward is in, as a fresh trace records them), packing a detach
  for each saved tensor that requires grad, up to its last save (torch's early stop); under
  "selective" the cached ops are not run again. Recomputed tensors get new storages; those
  saved die after the last backward op reading them, the others when the recomputation
  lets go of them. Each node then unpacks through the checkpoint's hook (a detach per saved
  tensor that requires grad) and reads the recomputed copies.

What autograd saved, when each node ran in backward, when Python let go of each saved tensor
and what each block was called with come from the trace (meta.autograd,
`gobrrr.capture.saved`). The new graph describes the checkpointed step and no longer carries
them (the pass applies to graphs traced without checkpointing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo, evolve
from gobrrr.graph.meta import AUTOGRAD_VERSION, StepMeta
from gobrrr.passes import gc_paused
from gobrrr.passes._blocks import DETACH, Block, Facts, make_block, python_death
from gobrrr.training.checkpointing import POLICIES, checkpoint_meta


def checkpoint(graph: StepGraph, policies: Mapping[str, str]) -> StepGraph:
    """The step of `graph` (traced without checkpointing) with each block in `policies`
    ({block name: "full" | "selective"}, names as meta.blocks lists them) checkpointed.
    Returns a new graph; `graph` is not changed."""
    _check(graph, policies)
    if not policies:
        return graph
    with gc_paused():
        facts = Facts(graph)
        blocks = sorted((make_block(facts, n, p) for n, p in policies.items()), key=lambda b: b.lo)
        for a, b in zip(blocks, blocks[1:], strict=False):
            if b.lo <= a.hi:
                raise GobrrrError(
                    f"checkpoint: blocks {a.name!r} and {b.name!r} overlap (one "
                    "is inside the other); checkpoint one of them"
                )
        out = _Builder(facts, blocks).build()
    meta = out.meta.with_pass(
        {"pass": "checkpoint", "policies": dict(policies)},
        checkpoint=checkpoint_meta(policies, list(graph.meta.blocks or [])),
        checkpointed_blocks=len(policies),
    )
    return dataclasses.replace(out, meta=meta)


def _check(graph: StepGraph, policies: Mapping[str, str]) -> None:
    for name, policy in policies.items():
        if policy not in POLICIES:
            raise GobrrrError(
                f"checkpoint: unknown policy {policy!r} for block {name!r}: "
                f"choose {', '.join(POLICIES)}"
            )
    if graph.meta.checkpoint_mode != "none" or any(n.phase == "recompute" for n in graph.nodes):
        raise GobrrrError(
            "checkpoint: the graph is already checkpointed (by gobrrr, or by the "
            "model itself, e.g. gradient_checkpointing_enable()); apply the pass "
            "to a graph traced without checkpointing"
        )
    autograd = graph.meta.autograd
    if autograd is not None and autograd.hooked:
        raise GobrrrError(
            "checkpoint: the step saves tensors for backward through saved-tensor "
            "hooks (the model checkpoints or offloads itself); trace it without"
        )
    if autograd is None or autograd.version != AUTOGRAD_VERSION or graph.meta.blocks is None:
        raise GobrrrError(
            "checkpoint: the graph does not record what its ops saved for "
            "backward (meta.autograd of this version); capture it again with "
            "this gobrrr"
        )


class _Builder:
    """Emits the new graph's nodes in order, then settles every storage's lifetime."""

    def __init__(self, facts: Facts, blocks: list[Block]) -> None:
        self.f, self.g, self.blocks = facts, facts.graph, blocks
        self.nodes: list[OpNode] = []
        self.new: dict[int, int] = {}  # original op -> its index in the new graph
        self.last: dict[int, int] = {}  # ... -> the last index it accounts for (its detaches)
        self.storages = list(self.g.storages)
        self.freed: dict[int, int | None] = {}  # storage -> freed (new index), where changed
        self.created: dict[int, int] = {}  # copy -> created (new index)
        self.remap: dict[int, tuple[int, Block]] = {}  # backward reads of sid -> copy
        self.dropped = self._dropped()
        self.rc: dict[int, int] = {}  # original op -> its recomputed copy's new index
        self.syncs = set(self.g.meta.syncs or ())
        self.new_syncs: list[int] = []
        self.kernel_clone = self._kernel_clones()
        self.inside = {i for c in blocks for i in range(c.lo, c.hi + 1)}  # checkpointed ops
        allocated = {sid for n in self.g.nodes for sid in n.allocs}
        # tensors first seen as an op's input (constants made from host data), no allocation
        self.constants = {s.id for s in self.g.storages if s.created >= 0} - allocated

    # -- emission ---------------------------------------------------------------------------
    def build(self) -> StepGraph:
        nodes = self.g.nodes
        for n in nodes[: self.f.first_bwd]:
            self._keep(n)
            b = self._block_of(n.index)
            if b is not None and b.cached(n.index, n):
                for t in n.outputs:  # the selective cache's detach of each output
                    self.last[n.index] = self._emit(DETACH, n.phase, n.module, (t,), (t,))
                    self._counted(n, 0)
        triggers, unpacks = {}, {}
        for b in sorted(self.blocks, key=lambda b: -b.lo):
            triggers.setdefault(b.trigger, []).append(b)
            for op, at in sorted(b.place.items(), reverse=True):
                unpacks.setdefault(at, []).append((b, op))
        for n in nodes[self.f.first_bwd :]:
            for b in triggers.get(n.index, ()):
                self._recompute(b, n.module)
            for b, op in unpacks.get(n.index, ()):
                self._unpack(b, op, n.module)
            self._keep(n, backward=True)
        self._settle()
        return self._graph()

    def _emit(
        self,
        op: str,
        phase: str,
        module: str,
        inputs: tuple,
        outputs: tuple,
        args=None,
        kwargs=None,
        allocs: tuple[int, ...] = (),
    ) -> int:
        index = len(self.nodes)
        self.nodes.append(
            OpNode(
                index,
                op,
                phase,
                module,
                tuple(inputs),
                tuple(outputs),
                args=({"t": 0},) if args is None else args,
                kwargs={} if kwargs is None else kwargs,
                allocs=allocs,
            )
        )
        return index

    def _keep(self, n: OpNode, backward: bool = False) -> None:
        if n.index in self.dropped:
            return
        inputs, outputs = n.inputs, n.outputs
        if backward:  # reads of recomputed tensors, and views of them
            inputs = tuple(self._read(t, n) for t in n.inputs)
            outputs = tuple(t if t.storage in n.allocs else self._read(t, n) for t in outputs)
        self.new[n.index] = self.last[n.index] = self._emit(
            n.op, n.phase, n.module, inputs, outputs, n.args, n.kwargs, n.allocs
        )
        self._counted(n, n.saved)

    def _counted(self, n: OpNode, saved: int | None) -> None:
        """The op just emitted saves `saved` tensors where the trace counted `n`'s (a
        checkpointed forward op's host cost grows with them)."""
        if n.saved is not None:
            self.nodes[-1] = evolve(self.nodes[-1], saved=saved)

    def _read(self, t: TensorInfo, n: OpNode) -> TensorInfo:
        hit = self.remap.get(t.storage)
        if hit is None or n.index < hit[1].trigger:
            return t
        copy, b = hit
        owner = self.f.owner.get(n.index)
        if owner is not None and not b.lo <= owner <= b.hi:
            return t  # a node outside the block saved the original and reads it
        return _on(t, copy)

    def _where(self, b: Block, module: str, trigger_module: str) -> tuple[str, str]:
        """Phase and module a recomputed op is recorded with."""
        if module == b.name:  # the block's own code: no module hook marks it recomputing
            return "backward", trigger_module
        return "recompute", module

    def _recompute(self, b: Block, trigger_module: str) -> None:
        nodes, copies = self.g.nodes, {}
        stop_op, stop_after = b.stop
        for i in range(b.lo, stop_op + 1):
            n = nodes[i]
            if i in self.dropped or i + 1 in self.kernel_clone:
                continue
            phase, module = self._where(b, n.module, trigger_module)
            clone = nodes[i - 1] if i in self.kernel_clone else None
            mine = set(clone.allocs) if clone else set()
            self._pack_detaches(b, i, False, phase, module, copies, lambda s, m=mine: s not in m)
            if clone is not None:  # in-place op i copies its input first, then saves the copy
                self._recompute_op(clone, *self._where(b, clone.module, trigger_module), copies)
                self.rc[clone.index] = len(self.nodes) - 1
                self._pack_detaches(b, i, False, phase, module, copies, mine.__contains__)
            if i == stop_op and not stop_after:
                break
            if b.cached(i, n):
                copies.update((sid, sid) for sid in n.allocs)
            else:
                self._recompute_op(n, phase, module, copies)
            self._pack_detaches(b, i, True, phase, module, copies)
            self.rc[i] = len(self.nodes) - 1  # where what died after op i dies again
        for sid, copy in copies.items():
            self.remap[sid] = (copy, b)
        b.copies, b.last = copies, len(self.nodes) - 1

    def _recompute_op(self, n: OpNode, phase: str, module: str, copies: dict) -> None:
        index = len(self.nodes)
        made = [(sid, index) for sid in n.allocs]  # and constants it reads, made anew each time
        made += [
            (t.storage, index - 1)
            for t in n.inputs
            if t.storage in self.constants and t.storage not in copies
        ]
        for sid, created in made:
            copies[sid] = len(self.storages)
            self.storages.append(
                StorageInfo(
                    len(self.storages),
                    self.g.storages[sid].nbytes,
                    "temporary",
                    created,
                    None,
                    module=module,
                )
            )
            self.created[copies[sid]] = created
        ren = lambda t: _on(t, copies[t.storage]) if t.storage in copies else t  # noqa: E731
        if n.index in self.syncs:  # it reads a value again: the host waits again
            self.new_syncs.append(index)
        self._emit(
            n.op,
            phase,
            module,
            tuple(map(ren, n.inputs)),
            tuple(map(ren, n.outputs)),
            n.args,
            n.kwargs,
            tuple(copies[sid] for sid in n.allocs),
        )

    def _pack_detaches(
        self,
        b: Block,
        i: int,
        after: bool,
        phase: str,
        module: str,
        copies: dict,
        which=lambda sid: True,
    ) -> None:
        for s in self.f.saves.get(i, ()):
            if s.after == after and s.requires_grad and which(s.view.storage):
                t = _on(s.view, copies.get(s.view.storage, s.view.storage))
                self._emit(DETACH, phase, module, (t,), (t,))

    def _unpack(self, b: Block, op: int, module: str) -> None:
        for s in self.f.saves.get(op, ()):
            if s.requires_grad:
                t = s.view
                hit = self.remap.get(t.storage)
                if hit is not None and hit[1] is b:
                    t = _on(t, hit[0])
                self._emit(DETACH, "backward", module, (t,), (t,))

    def _kernel_clones(self) -> set[int]:
        """In-place ops whose autograd copies the input it saves (a `clone` just before the op,
        saved by it): the copy is made after the op's other saves are packed."""
        nodes, out = self.g.nodes, set()
        for b in self.blocks:
            for i in range(b.lo + 1, b.hi + 1):
                prev = nodes[i - 1]
                if (
                    prev.name == "clone"
                    and nodes[i].name.endswith("_")
                    and any(
                        not s.after and s.view.storage in prev.allocs
                        for s in self.f.saves.get(i, ())
                    )
                ):
                    out.add(i)
        return out

    def _block_of(self, i: int) -> Block | None:
        return next((b for b in self.blocks if b.lo <= i <= b.hi), None)

    def _dropped(self) -> set[int]:
        """Detaches of the original that checkpointing does not run: a saved output's own
        detach in the forward (autograd's path without saved-tensor hooks), and the detach of
        unpacking a saved tensor of a checkpointed block in backward (replaced by the hook's)."""
        nodes, out = self.g.nodes, set()
        for b in self.blocks:
            saved = {s.view.storage for s in b.saves}
            for i in range(b.lo + 1, b.hi + 1):
                n = nodes[i]
                if n.op == DETACH and any(
                    s.after and s.view.storage == n.inputs[0].storage
                    for s in self.f.saves.get(i - 1, ())
                ):
                    out.add(i)
            for j in range(max(b.trigger, 0), b.end + 1):
                n = nodes[j]
                if n.op == DETACH and n.inputs[0].storage in saved & b.created:
                    out.add(j)
        return out

    # -- lifetimes ---------------------------------------------------------------------------
    def _at(self, old: int | None) -> int | None:
        """Where what died after original op `old` dies in the new graph: after the op and
        the detaches that go with it (a dropped op: after the op kept before it)."""
        if old is None or old < 0:
            return old
        while old not in self.last and old > 0:
            old -= 1
        return self.last.get(old, 0)

    def _settle(self) -> None:
        for b in self.blocks:
            if b.trigger < 0:
                continue
            self._originals(b)
            self._copies(b)
            self._inputs(b)

    def _originals(self, b: Block) -> None:
        """Saved tensors of the block die when Python lets go of them, or later where a node
        outside every checkpointed block saved them too (when that node is released), unless
        the selective cache keeps them."""
        inside = self.inside
        for sid in b.held - set(b.kept):
            death = python_death(self.f, sid)
            made = self.g.storages[sid].created
            if death is not None and made + 1 in self.kernel_clone:  # autograd's own copy
                death = max(death, made + 1)  # never a Python tensor: gone after its op
            others = self.f.saved_by.get(sid, set()) - inside
            ends = [last for op in others for _, last in self.f.spans.get(op, ())]
            if death is None or len(ends) < len(others):
                continue  # Python or an unreleased node holds it into backward: as it was
            self.freed[sid] = self._at(max([death, *ends]))
        for sid, op in b.kept.items():
            if not b.recomputed(op):  # never taken back by the recomputation: lives with it
                self.freed[sid] = self._at(b.end)

    def _copies(self, b: Block) -> None:
        for sid, copy in b.copies.items():
            if sid in b.kept and not b.recomputed(b.kept[sid]):
                continue
            if sid in b.held:  # unpacked with its node's other saves, released with them
                ends = [b.node_end[op] for op in self.f.saved_by[sid] if op in b.node_end]
                self.freed[copy] = self._at(max(ends))
            else:
                self.freed[copy] = self._local_death(b, sid)

    def _local_death(self, b: Block, sid: int) -> int:
        """Where a recomputed tensor nothing saves dies: where its original died in the
        forward, if the recomputation got that far; else when the recomputation stops."""
        f = self.g.storages[sid].freed
        if f is not None and f < self.f.first_bwd and f <= b.stop[0]:
            while f not in self.rc and f > b.lo:
                f -= 1
            if f in self.rc:
                return self.rc[f]
        return b.last

    def _inputs(self, b: Block) -> None:
        """The block's arguments stay alive until its last node is released (the checkpoint
        keeps what it recomputes from): those the trace saw it called with, else the tensors
        made before it that its ops read."""
        end = self._at(b.end)
        args = self.f.block_inputs.get(b.name)
        if args is None:
            args = {t.storage for i in range(b.lo, b.hi + 1) for t in self.g.nodes[i].inputs}
        for sid in args:
            s = self.g.storages[sid]
            if s.kind in ("activation", "temporary") and 0 <= s.created < b.lo:
                f = self.freed.get(sid, self._at(s.freed))
                if f is not None and f < end:
                    self.freed[sid] = end

    # -- assembly ----------------------------------------------------------------------------
    def _graph(self) -> StepGraph:
        first_bwd = next((n.index for n in self.nodes if n.phase != "forward"), len(self.nodes))
        storages, frees = [], {}
        for s in self.storages:
            created = self.created.get(s.id, self.new.get(s.created, s.created))
            freed = self.freed[s.id] if s.id in self.freed else self._at(s.freed)
            kind = s.kind
            if kind in ("activation", "temporary"):
                alive = 0 <= created < first_bwd and (freed is None or freed >= first_bwd)
                kind = "activation" if alive else "temporary"
            storages.append(StorageInfo(s.id, s.nbytes, kind, created, freed, s.label, s.module))
            if freed is not None and freed >= 0:
                frees.setdefault(freed, []).append(s.id)
        nodes = tuple(evolve(n, frees=tuple(frees.get(n.index, ()))) for n in self.nodes)
        return StepGraph(nodes=nodes, storages=tuple(storages), meta=self._meta())

    def _meta(self) -> StepMeta:
        # autograd: what it did in the plain step
        return self.g.meta.with_ops_moved(self._at, self.new_syncs).replace(autograd=None)


def _on(t: TensorInfo, storage: int) -> TensorInfo:
    """The same view of another storage (dataclasses.replace is slow in this loop)."""
    return TensorInfo(t.shape, t.stride, t.dtype, storage, t.offset)
