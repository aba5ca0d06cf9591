"""The step graph, the one representation every other part reads: `ir` (StepGraph, OpNode,
TensorInfo, StorageInfo, JSON), `meta` (the typed StepMeta and its saved-tensor rows)."""

from gobrrr.graph.ir import KINDS, PHASES, OpNode, StepGraph, StorageInfo, TensorInfo, itemsize

__all__ = ["KINDS", "PHASES", "OpNode", "StepGraph", "StorageInfo", "TensorInfo", "itemsize"]
