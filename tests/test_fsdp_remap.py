"""The FSDP2 pass's per-op storage maps: a unit's map is shared by its ops until one op's is
changed (`_Plan.own`), and the change stays that op's."""

from gobrrr.graph.ir import StepGraph
from gobrrr.graph.meta import StepMeta
from gobrrr.passes import fsdp


def _plan() -> fsdp._Plan:
    graph = StepGraph(nodes=(), storages=(), meta=StepMeta(name="t"))
    return fsdp._Plan(graph=graph, world=2, storages=[])


def test_a_shared_map_is_copied_before_one_op_changes_it():
    plan = _plan()
    unit = {7: 70}
    plan.remap.update({0: unit, 1: unit})
    plan.shared.add(id(unit))
    plan.own(1)[8] = 80
    assert plan.remap[0] == {7: 70}  # the other op's map as it was
    assert plan.remap[1] == {7: 70, 8: 80}
    assert plan.own(1) is plan.remap[1]  # its own now: changed in place from here
    assert plan.own(2) == {} and 2 in plan.remap
