"""Which tensors each forward op leaves saved for backward, read off the autograd graph.

Activation checkpointing changes exactly these: a checkpointed block keeps none of its saved
tensors and rebuilds them in backward, stopping once the last one is rebuilt. To predict that
from a graph traced without checkpointing (`gobrrr.passes.checkpoint`), the trace records,
for every autograd node alive when backward starts, the forward op that made it and what it
saved (rows of SAVED_FIELDS).

How: each forward op's outputs are watched (weak references, so no lifetime changes); once
autograd has attached their node (by the next op), the node's sequence number is tied to the
op. When backward starts, the graph is walked from every forward output still alive and each
node's saved tensors are unpacked (inside the recorder's dispatch, so the unpacking is not
recorded) and dropped again.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
import weakref
from typing import Any

import torch

from gobrrr.capture.recorder import StorageTable
from gobrrr.graph.ir import OpNode
from gobrrr.graph.meta import AUTOGRAD_VERSION, Autograd, NodeSpan, SavedRow, Unreferenced
from gobrrr.workload import iter_tensors

AUTOGRAD = "autograd"  # the graph's meta key (StepMeta.autograd)

#: The fields of the rows StepMeta.autograd holds (gobrrr.graph.meta documents each).
SAVED_FIELDS = SavedRow._fields
SPAN_FIELDS = NodeSpan._fields
UNREFERENCED_FIELDS = Unreferenced._fields

_WINDOW = 16  # ops an output is watched for its node before it is given up


class SavedTracker:
    """Ties autograd nodes to forward ops, then lists their saved tensors at backward's start.
    Call `on_op` after each recorded op (the Recorder does)."""

    def __init__(self, table: StorageTable) -> None:
        self.table = table
        self.seq_op: dict[int, int] = {}  # autograd sequence number -> forward op index
        self._pending: list[tuple[weakref.ref, int]] = []
        self._outputs: list[weakref.ref] = []  # every forward output: the walk's roots
        self._out_sids: dict[int, set[int]] = {}
        self.rows: list[list[Any]] | None = None  # set when backward starts
        self.spans: list[list[int]] = []
        self.unreferenced: list[list[int]] = []
        self.block_inputs: dict[str, list[int]] = {}
        self.unmapped = 0  # nodes whose op was guessed from their neighbours
        self._guessed: dict[int, int] = {}  # their sequence numbers -> the op guessed
        self.counts: dict[int, int] = {}  # forward op -> tensors its node saved
        self.first_backward: int | None = None  # the op backward started at
        self.hooked = False  # the forward packed saved tensors through hooks
        self._clock = -1  # the last op recorded
        self._held: list[tuple[weakref.ref, int]] | None = []  # forward tensors Python holds
        self._let_go: dict[int, int] = {}  # storage -> op after which Python let go of it
        self._site: tuple[int, ...] = ()  # the Python call the last op came from
        # outputs of the ops of the current call: [tensor, its use count, op after which it
        # last lost a C++ reference or None]
        self._local: list[list[Any]] = []

    def on_op(self, index: int, phase: str, outs: list[torch.Tensor], sids: list[int]) -> None:
        self._clock = index
        if self.rows is not None:  # what the first backward found is recorded; later
            return  # micro-batches of an accumulated step repeat it
        if phase == "forward" and not self.hooked:
            self.hooked = _hooks_active()
        site, self._site = self._site, _call_site()
        if self._held is not None:
            self._count_cpp(index)
            if phase != "forward" or site != self._site:
                self._release(index)  # (within one C++ call Python lets go of nothing)
        if phase == "forward":
            self._resolve(index)
            for t, sid in zip(outs, sids, strict=True):  # autograd attaches their node later
                ref = weakref.ref(t)
                self._pending.append((ref, index))
                self._outputs.append(ref)
                self._held.append((ref, sid))
                self._local.append([ref, t._use_count(), None])
            self._out_sids[index] = set(sids)
        elif self.rows is None:
            self._held = None
            self._resolve(index)
            self.first_backward = index
            fns = self._reachable()
            self.counts = self._count(fns)
            self.rows = [] if self.hooked else self._walk(fns)

    def meta(self) -> Autograd:
        """What the trace learnt, for StepMeta.autograd."""
        return Autograd.from_dict(
            {
                "version": AUTOGRAD_VERSION,
                "hooked": self.hooked,
                "saved": self.rows or [],
                "node_spans": sorted(self.spans),
                "unreferenced": self.unreferenced,
                "block_inputs": self.block_inputs,
            }
        )

    def watch_blocks(self, model: torch.nn.Module, names: list[str]) -> list[Any]:
        """Record the tensors each block in `names` is called with; returns the hook handles."""

        def hook(name):
            def pre(mod, args, kwargs):
                sids = {self.table.lookup(t) for t in iter_tensors((args, kwargs))}
                self.block_inputs[name] = sorted(sids - {None})

            return pre

        return [
            model.get_submodule(n).register_forward_pre_hook(hook(n), with_kwargs=True)
            for n in names
        ]

    def _count_cpp(self, now: int) -> None:
        """Note which tensors made since the call began lost a C++ reference before op `now`.
        A C++ composite (matmul, the math attention) holds its temporaries in C++ locals and
        drops them where its code ends their scope, well before it returns; where autograd
        saved one, its use count falls there instead of reaching zero."""
        for entry in self._local:
            t = entry[0]()
            count = -1 if t is None else t._use_count()
            if count < entry[1]:
                entry[2] = now - 1
            entry[1] = count

    def _release(self, now: int) -> None:
        """Note the storages whose every tensor Python has let go of since the last op: the
        tensor is dead, or only C++ holds it (autograd keeps what it saved as an input, and
        PyTorch keeps its Python object alive while it does). A tensor made within the call
        that just returned was held by C++ alone: let go of where it last lost a C++
        reference (`_count_cpp`), which is where it would have died had autograd not saved
        it (a real CPU step frees such temporaries there)."""
        cpp = {id(ref): op for ref, _, op in self._local if op is not None}
        self._local = []
        keep, gone = [], {}
        for ref, sid in self._held:
            t = ref()
            if t is None or not _python_holds(t):
                gone[sid] = max(gone.get(sid, -1), cpp.get(id(ref), now - 1))
            else:
                keep.append((ref, sid))
        held = {sid for _, sid in keep}  # a storage is let go of once all its views are
        for sid, op in gone.items():
            if sid not in held:
                self._let_go[sid] = op
        self._held = keep

    def _resolve(self, now: int) -> None:
        keep = []
        for ref, index in self._pending:
            t = ref()
            if t is None or t._is_view():  # a view's grad_fn may be rebuilt (with ops, under
                continue  # a lock this dispatch may hold); its node saves nothing anyway
            fn = t.grad_fn
            if fn is not None:
                self.seq_op.setdefault(fn._sequence_nr(), index)
            elif now - index < _WINDOW:
                keep.append((ref, index))
        self._pending = keep

    def counted(self, nodes: tuple[OpNode, ...]) -> tuple[OpNode, ...]:
        """`nodes` with each forward op before backward's start given `saved`: the tensors
        its autograd node saved (0: none, or no node). Later micro-batches' forward ops are
        not walked and keep None."""
        end = self.first_backward
        if end is None:
            return nodes
        return tuple(
            dataclasses.replace(n, saved=self.counts.get(n.index, 0))
            if n.index < end and n.phase == "forward"
            else n
            for n in nodes
        )

    def _reachable(self) -> list[Any]:
        """Every autograd node reachable from a forward output still alive."""
        seen: dict[int, Any] = {}
        todo = [
            t.grad_fn
            for r in self._outputs
            if (t := r()) is not None and not t._is_view() and t.grad_fn
        ]
        while todo:
            fn = todo.pop()
            if fn is None or id(fn) in seen:
                continue
            seen[id(fn)] = fn
            todo.extend(f for f, _ in fn.next_functions)
        return list(seen.values())

    def _count(self, fns: list[Any]) -> dict[int, int]:
        """Tensors saved per forward op, counted without unpacking them: under a checkpoint's
        hooks unpacking would recompute the block, and the hook packed each one once."""
        seqs = sorted(self.seq_op)
        out: dict[int, int] = {}
        for fn in fns:
            if n := _saved_count(fn):
                index = self._op_of(fn._sequence_nr(), seqs)
                out[index] = out.get(index, 0) + n
        return out

    def _walk(self, fns: list[Any]) -> list[list[Any]]:
        seqs = sorted(self.seq_op)
        rows = []
        for fn in fns:
            saved = _saved_tensors(fn)
            if saved:
                index = self._op_of(fn._sequence_nr(), seqs)
                rows.extend(self._row(index, t) for t in saved)
                self._watch(fn, index)
        rows.sort(key=lambda r: (r[0], r[2]))
        saved = {r[1] for r in rows}
        self.unreferenced = sorted([sid, op] for sid, op in self._let_go.items() if sid in saved)
        return rows

    def _watch(self, fn: Any, index: int) -> None:
        """Record the ops node `fn` runs in backward (hooks hold no tensor)."""
        span = [index, -1, -1]

        def pre(grad_outputs):
            span[1] = self._clock + 1

        def post(grad_inputs, grad_outputs):
            span[2] = self._clock
            self.spans.append(span)

        fn.register_prehook(pre)
        fn.register_hook(post)

    def _op_of(self, seq: int, seqs: list[int]) -> int:
        index = self.seq_op.get(seq, self._guessed.get(seq))
        if index is None:  # its outputs died before it could be tied: the op before it
            self.unmapped += 1
            i = bisect.bisect_left(seqs, seq)
            index = self._guessed[seq] = self.seq_op[seqs[i - 1]] if i else 0
        return index

    def _row(self, index: int, t: torch.Tensor) -> list[Any]:
        sid = self.table.lookup(t)
        return [
            index,
            sid,
            sid in self._out_sids.get(index, ()),
            bool(t.requires_grad),
            [int(s) for s in t.shape],
            [int(s) for s in t.stride()],
            str(t.dtype).removeprefix("torch."),
            int(t.storage_offset()),
        ]


# frames of the dispatch itself: gobrrr's modes, torch's op and mode wrappers
_MACHINERY = (
    "/gobrrr/capture/",
    "/torch/utils/_python_dispatch",
    "/torch/_ops.py",
    "/torch/_subclasses/",
    "/torch/_dynamo/",
    "/torch/_compile.py",
)


def _call_site(depth: int = 6) -> tuple[int, ...]:
    """The Python call the op being recorded comes from: the frames and instructions of its
    caller and theirs (a frame's id alone is reused by the next call of the same function).
    Ops of one C++ call (a composite such as matmul: expand, clone, bmm, view) share it, and
    their C++ temporaries die when it returns, though no Python object ever held them."""
    f = sys._getframe(1)
    while f is not None and any(m in f.f_code.co_filename for m in _MACHINERY):
        f = f.f_back
    site = []
    while f is not None and len(site) < 2 * depth:
        site += (id(f), f.f_lasti)
        f = f.f_back
    return tuple(site)


def _hooks_active() -> bool:
    """Whether saved-tensor hooks are active (checkpointing, offloading): unpacking what such
    a node saved would run them (a checkpoint would recompute its block), so the graph is not
    walked. (torch < 2.8 cannot tell: taken as not.)"""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        return top(False) is not None
    except TypeError:
        return top() is not None


def _python_holds(t: torch.Tensor) -> bool:
    """Whether anything in Python refers to `t` beyond the caller's one reference. Its
    reference count then also counts the argument, and, while C++ shares the tensor (its use
    count > 1), the reference PyTorch's preservation of its Python object adds."""
    return sys.getrefcount(t) - (t._use_count() > 1) > 3


def _saved_count(fn: Any) -> int:
    """How many tensors autograd node `fn` saved through the saved-tensor hooks (a defined
    one: packed data not None, and not a Python number autograd wrapped, which it saves
    without calling the hooks), read off its raw saved variables, which are not unpacked."""
    n = 0
    for name in dir(fn):
        if not name.startswith("_raw_saved_"):
            continue
        try:
            value = getattr(fn, name)
        except RuntimeError:  # freed already
            continue
        for v in value if isinstance(value, (list, tuple)) else (value,):
            data = _packed(v)
            n += data is not None and not _wrapped_number(data)
    return n


#: the dtypes autograd wraps a Python bool, int, float or complex in (a 0-dim CPU tensor)
_WRAPPED = (torch.bool, torch.int64, torch.float64, torch.complex128)


def _wrapped_number(data: Any) -> bool:
    """Whether saved `data` is a Python number's wrapper (`x * 2.0`'s 2.0): a 0-dim CPU
    tensor in a wrapped number's dtype that is no fake tensor (a fake trace leaves the
    wrapper real; no hook packed it, so it is a tensor, not a hook's holder)."""
    return (
        type(data) is torch.Tensor
        and data.dim() == 0
        and data.device.type == "cpu"
        and data.dtype in _WRAPPED
    )


def _packed(v: Any) -> Any:
    """What a raw saved variable holds (its tensor, or what a hook packed it into), or None."""
    try:
        return getattr(v, "data", None)
    except RuntimeError:
        return None


def _saved_tensors(fn: Any) -> list[torch.Tensor]:
    """The tensors autograd node `fn` saved, unpacked, in the order of their names."""
    out: list[torch.Tensor] = []
    for name in dir(fn):
        if not name.startswith("_raw_saved_"):
            continue
        field = name.removeprefix("_raw_saved_")
        try:
            value = (
                fn.saved_tensors
                if field == "tensors" and not hasattr(fn, "_saved_tensors")
                else getattr(fn, "_saved_" + field)
            )
        except RuntimeError:  # freed already, or modified in place since it was saved
            continue
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out
