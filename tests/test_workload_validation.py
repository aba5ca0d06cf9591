"""Workload.validate: a Workload written wrong fails when it is made, before any trace, with a
message in the Workload's own terms; what the model, loss or step return is checked too."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gobrrr.errors import GobrrrError
from gobrrr.workload import Workload, extract_loss


def mlp():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


X = (torch.randn(2, 4),)


def mse(y, b):
    return y.square().mean()


def test_a_correct_workload_passes_and_runs_a_step():
    w = Workload(model=mlp(), batch=X, loss=mse)
    loss = w.compute_loss(w.batch)
    loss.backward()
    w.make_optimizer().step()
    assert loss.dim() == 0


@pytest.mark.parametrize(
    "kwargs,message,hint",
    [
        (dict(model=None), "Workload(model=None) is None", "nn.Module"),
        (dict(model=lambda x: x), "is a function", "wrap it in an nn.Module"),
        (dict(model=nn.Linear), "Workload(model=Linear) is the class", "model=Linear(...)"),
        (dict(batch=None), "Workload(batch=None)", "tensor"),
        (
            dict(batch=(np.ones((2, 4), np.float32),)),
            "batch[0] is a numpy ndarray",
            "torch.from_numpy(batch[0])",
        ),
        (dict(batch=("text",)), "holds no tensor", "tensors"),
        (
            dict(batch=(torch.randn(2, 4), torch.randn(2))),
            "model(*batch) with 2 arguments",
            "step=lambda model, batch",
        ),
        (dict(batch={"inputs": torch.randn(2, 4)}), "model(**batch) with keys inputs", "step="),
        (dict(loss="mse"), "Workload(loss='mse') is a str", "loss(output, batch)"),
        (dict(loss=lambda y: y.mean()), "cannot be called as loss(output, batch)", "two arguments"),
        (dict(step=lambda m, b: m(b[0]).sum()), "both loss= and step=", "give one"),
        (dict(optimizer="adamw"), "Workload(optimizer='adamw') is a str", "lambda params"),
        (dict(optimizer=lambda: None), "cannot be called as optimizer(params)", "lambda params"),
        (dict(tokens=0), "Workload(tokens=0)", "int > 0"),
        (dict(tokens=True), "Workload(tokens=True)", "int > 0"),
        (dict(seq_len=-1), "Workload(seq_len=-1)", "int > 0"),
        (dict(name=""), "Workload(name='')", "string"),
        (dict(info=[1]), "Workload(info=...) is a list", "dict"),
    ],
)
def test_each_mistake_is_named_in_the_workloads_terms(kwargs, message, hint):
    base = dict(model=mlp(), batch=X, loss=mse)
    with pytest.raises(GobrrrError) as e:
        Workload(**{**base, **kwargs})
    assert message in e.value.message and hint in e.value.hint


def test_an_optimizer_instance_is_turned_into_the_factory_to_write():
    m = mlp()
    with pytest.raises(GobrrrError) as e:
        Workload(model=m, batch=X, loss=mse, optimizer=torch.optim.SGD(m.parameters(), lr=0.05))
    assert "instance of SGD" in e.value.message
    assert "optimizer=lambda params: torch.optim.SGD(params, lr=0.05)" in e.value.hint


def test_frozen_models_have_nothing_to_train():
    m = mlp().requires_grad_(False)
    with pytest.raises(GobrrrError, match="no trainable parameters"):
        Workload(model=m, batch=X, loss=mse)


def test_an_optimizer_class_is_a_factory():
    w = Workload(model=mlp(), batch=X, loss=mse, optimizer=torch.optim.SGD)
    assert isinstance(w.make_optimizer(), torch.optim.SGD)


def test_what_the_factory_returns_and_raises():
    with pytest.raises(GobrrrError, match="returned NoneType, not a torch.optim.Optimizer"):
        Workload(model=mlp(), batch=X, loss=mse, optimizer=lambda p: None).make_optimizer()
    w = Workload(model=mlp(), batch=X, loss=mse, optimizer=lambda p: torch.optim.SGD(p, lr=-1))
    with pytest.raises(GobrrrError, match="raised ValueError: Invalid learning rate"):
        w.make_optimizer()


@pytest.mark.parametrize(
    "loss,message",
    [
        (lambda y, b: 1.0, "returned 1.0 (float), not a loss tensor"),
        (lambda y, b: y.square(), "a loss of shape (2, 1), not a scalar"),
        (lambda y, b: y.mean().detach(), "does not depend on the model's parameters"),
        (lambda y, b: F.cross_entropy(y, b), "raised TypeError"),
    ],
)
def test_what_the_loss_returns_is_checked(loss, message):
    w = Workload(model=mlp(), batch=X, loss=loss)
    with pytest.raises(GobrrrError) as e:
        w.compute_loss(w.batch)
    assert message in e.value.message


def test_a_detached_loss_is_fine_where_no_gradient_is_asked_for():
    w = Workload(model=mlp(), batch=X, loss=lambda y, b: y.mean().detach())
    with torch.no_grad():
        assert w.compute_loss(w.batch).dim() == 0


def test_step_is_checked_like_a_loss():
    with pytest.raises(GobrrrError, match="cannot be called as step"):
        Workload(model=mlp(), batch=X, step=lambda m: 0)
    w = Workload(model=mlp(), batch=X, step=lambda m, b: 0.5)
    with pytest.raises(GobrrrError, match=r"Workload\(step=...\) returned 0.5"):
        w.compute_loss(w.batch)


class Out:
    def __init__(self, loss):
        self.loss = loss


@pytest.mark.parametrize(
    "wrap", [lambda t: t, lambda t: Out(t), lambda t: {"loss": t}, lambda t: (t, "logits")]
)
def test_the_loss_is_found_where_models_put_it(wrap):
    t = torch.ones((), requires_grad=True) * 2
    assert extract_loss(wrap(t)) is t


def test_a_model_output_without_its_loss_asks_for_labels():
    with pytest.raises(GobrrrError) as e:
        extract_loss(Out(None))
    assert "loss=None" in e.value.message and "labels" in e.value.hint
