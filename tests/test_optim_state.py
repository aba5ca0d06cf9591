"""The warm-up step's optimizer state made directly (`capture.optim_state`) gives the graph the
warm-up step gives, byte for byte."""

import pytest
import torch

from gobrrr.capture import capture, optim_state
from gobrrr.models.registry import get_workload

TINY = dict(n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=256)


def _tiny(make_optimizer=None):
    def build():
        w = get_workload("llama3-1b", 2, 32, **TINY)
        if make_optimizer is not None:
            w.optimizer = make_optimizer
        return w

    return build


def _traced(monkeypatch, source, precision: str, direct: bool) -> str:
    with monkeypatch.context() as m:
        if not direct:  # the optimizer's own first step, as for any optimizer
            m.setattr(optim_state, "direct", lambda opt: False)
        return capture(source, precision=precision).to_json()


@pytest.mark.parametrize(
    ("make_optimizer", "precision"),
    [
        (None, "bf16-mixed"),  # the built-ins' AdamW, foreach (as CUDA picks)
        (None, "bf16"),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False), "fp32"),
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, weight_decay=0.1), "bf16-mixed"),
    ],
)
def test_direct_state_traces_the_same_step(monkeypatch, make_optimizer, precision):
    calls = []
    init = optim_state.init_state
    monkeypatch.setattr(optim_state, "init_state", lambda opt: calls.append(1) or init(opt))
    source = _tiny(make_optimizer)
    direct = _traced(monkeypatch, source, precision, direct=True)
    assert calls  # the direct path ran
    # the step count lands in the recorded update's arguments (Adam's bias corrections)
    assert direct == _traced(monkeypatch, source, precision, direct=False)


def test_what_is_not_made_directly():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert optim_state.direct(torch.optim.AdamW(p))
    assert not optim_state.direct(torch.optim.AdamW(p, fused=True))
    assert not optim_state.direct(torch.optim.Adam(p, capturable=True))
    assert not optim_state.direct(torch.optim.SGD(p, lr=0.1))

    class Mine(torch.optim.AdamW):  # a subclass may step differently
        pass

    assert not optim_state.direct(Mine(p))
    hooked = torch.optim.AdamW(p)
    hooked.register_step_pre_hook(lambda opt, args, kwargs: None)
    assert not optim_state.direct(hooked)
