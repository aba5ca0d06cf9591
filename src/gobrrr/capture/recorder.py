"""A dispatch-mode recorder: every ATen op of a step, with exact storage lifetimes.

Storages are the unit of memory (one storage = one allocation on a CUDA device). A storage is
born with the first op that outputs it and dies when its last reference goes: a weakref
finalizer on the storage fires at that moment, in eager order, so the lifetimes are the ones
the real step would have.
"""

from __future__ import annotations

import functools
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gobrrr.capture.compiled import ignore_compile_internals
from gobrrr.graph.ir import OpNode, StorageInfo, TensorInfo
from gobrrr.graph.meta import ModelOutput

SUM_OP = "aten.add.Tensor"  # the engine's sum of two gradients in an input buffer

# Ops that only read metadata; they produce no tensor and cost nothing.
_SKIP = {
    "aten.sym_size",
    "aten.sym_stride",
    "aten.sym_numel",
    "aten.sym_storage_offset",
    "prim.device",
    "aten.is_same_size",
    "aten._local_scalar_dense",
}

# Tensor subclasses whose own __torch_dispatch__ runs beneath the recorder, so that what is
# recorded is what it runs on plain tensors: torchao's float8 training tensor, whose `mm` is the
# `_scaled_mm` a GPU runs (the op on the subclass itself would be a bf16 `mm`).
SEE_THROUGH = frozenset({"torchao.float8.float8_training_tensor.Float8TrainingTensor"})


@functools.cache
def _see_through(cls: type) -> bool:
    return f"{cls.__module__}.{cls.__qualname__}" in SEE_THROUGH


@dataclass
class _Storage:
    id: int
    nbytes: int
    kind: str
    created: int
    freed: int | None = None
    label: str = ""
    module: str = ""
    host: bool = False  # lives in host memory on a real GPU run (e.g. optimizer step counters)


class StorageTable:
    """Maps live storages to ids and records when each one dies."""

    def __init__(self) -> None:
        self.records: list[_Storage] = []
        self._live: dict[int, int] = {}  # storage _cdata -> id, while alive
        self._finalizers: list[weakref.finalize] = []
        self.clock = -1  # index of the last recorded op

    def lookup(self, t: torch.Tensor) -> int | None:
        return self._live.get(t.untyped_storage()._cdata)

    def register(self, t: torch.Tensor, kind: str, label: str = "", module: str = "") -> int:
        st = t.untyped_storage()
        key = st._cdata
        sid = self._live.get(key)
        if sid is not None:
            return sid
        sid = len(self.records)
        self.records.append(
            _Storage(sid, st.nbytes(), kind, self.clock, label=label, module=module)
        )
        self._live[key] = sid
        self._finalizers.append(weakref.finalize(st, self._died, key, sid))
        return sid

    def _died(self, key: int, sid: int) -> None:
        if self._live.get(key) == sid:
            del self._live[key]
        self.records[sid].freed = self.clock

    def close(self) -> None:
        """Stop watching: what is alive now survives the step."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()

    def infos(self) -> tuple[StorageInfo, ...]:
        return tuple(
            StorageInfo(
                id=r.id,
                nbytes=0 if r.host else r.nbytes,
                kind=r.kind,
                created=r.created,
                freed=r.freed,
                label=r.label,
                module=r.module,
            )
            for r in self.records
        )


def _jsonable(x: Any, refs: dict[int, int]) -> Any:
    """Non-tensor args as JSON values; a tensor becomes {"t": index into inputs}."""
    if isinstance(x, torch.Tensor):
        return {"t": refs[id(x)]}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, refs) for v in x]
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(x)
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        return str(x)
    return _ADDRESS.sub("", repr(x))  # "<torch.ScriptObject object>": same in every trace


# A default repr's memory address differs between two traces of one step.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def is_engine_sum(recorder: Recorder, name: str, args: tuple) -> bool:
    """Whether the op being recorded is the engine summing two gradients in an input buffer
    that the GPU's engine may sum in place: an `add` under the node whose formula has just
    run, grad mode off, and a first gradient that is not a view (a view keeps its base, and
    so its storage, referenced twice: `can_accumulate_inplace` refuses it). Why the GPU's sum
    differs from the trace's: gobrrr.capture.accumulate."""
    node = recorder.after_node
    return (
        node is not None
        and name == SUM_OP
        and not torch.is_grad_enabled()
        and torch._C._current_autograd_node() is node
        and len(args) >= 2
        and isinstance(args[0], torch.Tensor)
        and not args[0]._is_view()
    )


class Recorder(TorchDispatchMode):
    """Records each ATen op as an OpNode. `phase` and `module` are set by the driver."""

    ignore_compile_internals = classmethod(ignore_compile_internals)

    def __init__(self, table: StorageTable, module_of, phase_of, on_op=None) -> None:
        super().__init__()
        self._on_op = on_op  # on_op(index, phase, output tensors, their storage ids)
        self.table = table
        self.nodes: list[OpNode] = []
        self._module_of = module_of
        self._phase_of = phase_of
        self._names: dict = {}
        self.after_node: Any = None  # the backward node whose formula ran last (accumulate)
        self.engine_sums: list[int] = []  # ops where the engine summed two gradients
        self.outputs: list[ModelOutput] = []  # what the model's forward calls returned

    def mark_output(self, out: Any) -> None:
        """Mark the tensors of what a call of the model's forward returned (reached through
        tuples, lists, dicts and plain objects' attributes, e.g. HF's ModelOutput and its KV
        cache), as of the last op recorded: the loop pass (`gobrrr.passes.loop`) keeps them
        alive as a loop holding `out = model(...)` does."""
        marked: set[int] = set()
        for path, t, contained in _returned_tensors(out, "", set(), depth=0):
            sid = self.table.lookup(t)
            if sid is not None and sid not in marked:
                marked.add(sid)
                shape = tuple(int(s) for s in t.shape)
                dtype = str(t.dtype).removeprefix("torch.")
                at = len(self.nodes) - 1
                self.outputs.append(ModelOutput(at, sid, path, shape, dtype, contained))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_see_through(t) for t in types):
            return NotImplemented  # the subclass runs it; its ops come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = self._names.get(func)
        if name is None:  # str(func) once per op: tensor.device alone dispatches thousands
            name = self._names[func] = str(func)
            if name.rsplit(".", 1)[0] in _SKIP:
                self._names[func] = name = ""
        if name:
            if self.after_node is not None and is_engine_sum(self, name, args):
                self.engine_sums.append(len(self.nodes))
            self._record(name, args, kwargs, out)
        return out

    def _tinfo(self, t: torch.Tensor, module: str) -> TensorInfo:
        sid = self.table.lookup(t)
        if sid is None:  # first seen as an output of this op (or a constant from outside)
            sid = self.table.register(t, "temporary", module=module)
        return TensorInfo(
            tuple(int(s) for s in t.shape),
            tuple(int(s) for s in t.stride()),
            str(t.dtype).removeprefix("torch."),
            sid,
            int(t.storage_offset()),
        )

    def _record(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        index = len(self.nodes)
        module, phase = self._module_of(), self._phase_of()
        in_flat: list[torch.Tensor] = []
        _tensors_of(args, in_flat)
        _tensors_of(kwargs, in_flat)
        refs: dict[int, int] = {}
        inputs: list[TensorInfo] = []
        for t in in_flat:
            if id(t) not in refs:
                refs[id(t)] = len(inputs)
                inputs.append(self._tinfo(t, module))
        self.table.clock = index
        before = len(self.table.records)
        out_flat: list[torch.Tensor] = []
        _tensors_of(out, out_flat)
        outputs = [self._tinfo(t, module) for t in out_flat]
        allocs = tuple(range(before, len(self.table.records)))
        for sid in allocs:
            self.table.records[sid].created = index
        self.nodes.append(
            OpNode(
                index=index,
                op=name,
                phase=phase,
                module=module,
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                args=tuple(_jsonable(a, refs) for a in args),
                kwargs={k: _jsonable(v, refs) for k, v in kwargs.items()},
                allocs=allocs,
            )
        )
        if self._on_op is not None:
            self._on_op(index, phase, out_flat, [t.storage for t in outputs])


def _tensors_of(x: Any, into: list[torch.Tensor]) -> None:
    """The tensors in an ATen op's arguments or results, in `tree_flatten`'s order (tuples,
    lists and dicts are all an op's schema holds; a third of pytree's cost per op)."""
    if isinstance(x, torch.Tensor):
        into.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _tensors_of(v, into)
    elif isinstance(x, dict):
        for v in x.values():
            _tensors_of(v, into)


def _returned_tensors(x: Any, path: str, seen: set[int], depth: int, contained: bool = True):
    """(path, tensor, contained) of every tensor in a returned structure, depth-first, each
    object once (`seen` by id); modules and classes are not entered (their tensors are
    parameters). `contained`: reached through tuples, lists and dicts alone, as Accelerate's
    `convert_to_fp32` walks it (an object's attribute on the way: False)."""
    if id(x) in seen or depth > 6:
        return
    if isinstance(x, torch.Tensor):
        yield path or "output", x, contained
        return
    if x is None or isinstance(x, (str, bytes, int, float, bool, type, torch.nn.Module)):
        return
    seen.add(id(x))
    if isinstance(x, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in x.items())
    elif isinstance(x, (tuple, list)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(x))
    else:
        fields = getattr(x, "__dict__", None)
        if not isinstance(fields, dict):
            return
        items = ((f"{path}.{k}" if path else k, v) for k, v in fields.items())
        contained = False
    for p, v in items:
        yield from _returned_tensors(v, p, seen, depth + 1, contained)
