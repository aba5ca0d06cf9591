"""Gradients the autograd engine sums in place, as it does on a GPU and not on fake tensors.

When two backward nodes send a gradient to the same input (a residual connection, a tensor
used twice), the engine sums them in the receiving node's input buffer
(torch/csrc/autograd/input_buffer.cpp, `accumulate`). With grad mode off (a plain backward),
it adds the new gradient into the first one in place (`old.add_(new)`) when the first is an
ordinary dense tensor that nothing else holds (`can_accumulate_inplace`: its TensorImpl and
its storage are referenced only by the buffer); otherwise it allocates the sum
(`old + new`). A FakeTensor is a tensor subclass, and `can_accumulate_inplace` refuses
subclasses (as it does under any Python dispatch mode), so the trace always sees the
allocating form: one extra gradient-sized block per join, which on a GPU is not there.

`watch` flags the engine's sums while the trace runs: a post-hook on every node of the
backward graph marks where the node's own formula ends; an `add` the engine then makes, still
under that node, is a sum into an input buffer (unless the first gradient is a view: a view
keeps its base, so its storage is referenced twice); the recorder flags it
(`recorder.is_engine_sum`). `in_place` rewrites the traced storages
as the GPU's engine would have them: where the first gradient's storage died at the sum
(nothing else held it) and it is dense with the sum's dtype and shape, the sum is written
into it: the sum allocates nothing, and its block is the one made for the first gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gobrrr.capture.recorder import Recorder, _Storage
from gobrrr.graph.ir import OpNode


def watch(loss: torch.Tensor, recorder: Recorder) -> list[Any]:
    """Post-hooks on every node reachable from `loss`'s grad_fn that tell `recorder` the node's
    formula has run (`Recorder.after_node`); returns the handles to remove after backward."""
    handles, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)

        def done(grad_inputs, grad_outputs, node=node) -> None:
            recorder.after_node = node

        handles.append(node.register_hook(done))
        todo.extend(f for f, _ in node.next_functions)
    return handles


def in_place(records: list[_Storage], nodes: list[OpNode], sums: list[int]) -> int:
    """Rewrite the trace for the engine's sums at op indices `sums` that the GPU makes in
    place (see the module docstring): the sum's storage is the first gradient's block, so
    it is allocated where the first gradient was (that op's `allocs` name the sum's storage
    instead) and the first gradient's own storage counts no bytes. What later passes know of
    the sum (a parameter's .grad, its kind and label) stays on the storage that holds the
    bytes. `records` and `nodes` are changed in place; returns how many sums were rewritten."""
    made_by = {sid: node.index for node in nodes for sid in node.allocs}
    done = 0
    for i in sums:
        node = nodes[i]
        if len(node.inputs) != 2 or len(node.outputs) != 1 or node.kwargs.get("alpha", 1) != 1:
            continue
        first, out = node.inputs[0], node.outputs[0]
        old, new = first.storage, out.storage
        if (
            records[old].freed != i
            or new == old
            or new not in node.allocs
            or old not in made_by
            or first.dtype != out.dtype
            or first.shape != out.shape
            or not first.is_dense()
        ):
            continue
        maker = nodes[made_by[old]]
        nodes[maker.index] = dataclasses.replace(
            maker, allocs=tuple(new if s == old else s for s in maker.allocs)
        )
        nodes[i] = dataclasses.replace(node, allocs=tuple(s for s in node.allocs if s != new))
        made_by[new] = maker.index
        records[new].created = records[old].created
        records[new].nbytes = max(records[new].nbytes, records[old].nbytes)
        records[old].nbytes = 0
        done += 1
    return done
