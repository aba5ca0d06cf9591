"""Files the first-contact corpus writes before a case runs: a user's workload file full of
the mistakes people make, and GPU spec files with bad values."""

BAD_WORKLOADS = '''
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gobrrr


def _mlp():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def _x(b=4):
    return (torch.randn(b, 8),)


def _mse(y, batch):
    return y.square().mean()


class TwoIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 3)

    def forward(self, x, y=None):
        return self.l(x)


class Forward(nn.Module):
    """A model whose forward does what the name of the case says."""

    def __init__(self, what):
        super().__init__()
        self.l = nn.Linear(8, 1)
        self.what = what

    def forward(self, x):
        if self.what == "numpy":
            x = torch.from_numpy(np.tanh(x.detach().numpy()))
        if self.what == "item" and x.sum().item() > 0:
            x = x * 2
        if self.what == "tolist":
            x = x * len([v for v in x.sum(1).tolist() if v > 0])
        if self.what == "print":
            print("hello from forward")
        if self.what == "none":
            return None
        if self.what == "string":
            return "loss"
        if self.what == "vector":
            return self.l(x)
        return self.l(x).sum()


def good(batch_size=4):
    return gobrrr.Workload(model=_mlp(), batch=_x(batch_size), loss=_mse)


def no_args():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse)


def opt_instance():
    m = _mlp()
    return gobrrr.Workload(model=m, batch=_x(), loss=_mse,
                           optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def opt_string():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse, optimizer="adamw")


def opt_int():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse, optimizer=3)


def opt_returns_none():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse, optimizer=lambda p: None)


def opt_no_arg():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse,
                           optimizer=lambda: torch.optim.SGD(lr=0.1))


def opt_bad_lr():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse,
                           optimizer=lambda p: torch.optim.SGD(p, lr=-1.0))


def model_none():
    return gobrrr.Workload(model=None, batch=_x(), loss=_mse)


def model_function():
    return gobrrr.Workload(model=lambda x: x * 2, batch=_x(), loss=_mse)


def model_class():
    return gobrrr.Workload(model=nn.Linear, batch=_x(), loss=_mse)


def model_string():
    return gobrrr.Workload(model="gpt2", batch=_x(), loss=_mse)


def model_frozen():
    m = _mlp()
    for p in m.parameters():
        p.requires_grad_(False)
    return gobrrr.Workload(model=m, batch=_x(), loss=_mse)


def model_no_params():
    return gobrrr.Workload(model=nn.ReLU(), batch=_x(), loss=_mse)


def batch_none():
    return gobrrr.Workload(model=_mlp(), batch=None, loss=_mse)


def batch_numpy():
    return gobrrr.Workload(model=_mlp(), batch=(np.zeros((4, 8), np.float32),), loss=_mse)


def batch_numpy_in_dict():
    return gobrrr.Workload(model=Forward("sum"), batch={"x": np.zeros((4, 8), np.float32)})


def batch_no_tensor():
    return gobrrr.Workload(model=_mlp(), batch=[1, 2, 3], loss=_mse)


def batch_inputs_and_labels():
    return gobrrr.Workload(model=_mlp(), batch=(torch.randn(4, 8), torch.randint(0, 2, (4,))),
                           loss=_mse)


def batch_wrong_keys():
    return gobrrr.Workload(model=Forward("sum"), batch={"inputs": torch.randn(4, 8)})


def loss_float():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=lambda y, b: 1.0)


def loss_not_scalar():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=lambda y, b: y.square())


def loss_detached():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=lambda y, b: y.mean().detach())


def loss_string():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss="mse")


def loss_one_arg():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=lambda y: y.mean())


def loss_on_whole_batch():
    return gobrrr.Workload(model=TwoIn(), batch=(torch.randn(4, 8), torch.randint(0, 3, (4,))),
                           loss=F.cross_entropy)


def loss_and_step():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse, step=lambda m, b: m(b[0]).sum())


def step_not_callable():
    return gobrrr.Workload(model=_mlp(), batch=_x(), step="train")


def step_one_arg():
    return gobrrr.Workload(model=_mlp(), batch=_x(), step=lambda m: m.sum())


def step_returns_float():
    return gobrrr.Workload(model=_mlp(), batch=_x(), step=lambda m, b: 0.5)


def step_returns_dict():
    return gobrrr.Workload(model=_mlp(), batch=_x(), step=lambda m, b: {"logits": m(b[0])})


def model_returns_vector():
    return gobrrr.Workload(model=Forward("vector"), batch=_x())


def model_returns_none():
    return gobrrr.Workload(model=Forward("none"), batch=_x())


def model_returns_string():
    return gobrrr.Workload(model=Forward("string"), batch=_x())


def tokens_negative():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse, tokens=-3)


def tokens_float():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse, tokens=2.5)


def seq_len_zero():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse, seq_len=0)


def name_number():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse, name=3)


def info_list():
    return gobrrr.Workload(model=_mlp(), batch=_x(), loss=_mse, info=["layers", 2])


def numpy_in_forward():
    return gobrrr.Workload(model=Forward("numpy"), batch=_x())


def item_in_forward():
    return gobrrr.Workload(model=Forward("item"), batch=_x())


def tolist_in_forward():
    return gobrrr.Workload(model=Forward("tolist"), batch=_x())


def shape_mismatch():
    return gobrrr.Workload(model=nn.Linear(7, 1), batch=_x(), loss=_mse)


def print_in_forward(batch_size=4):
    return gobrrr.Workload(model=Forward("print"), batch=_x(batch_size))


def print_while_building(batch_size=4):
    print("building the model")
    return gobrrr.Workload(model=_mlp(), batch=_x(batch_size), loss=_mse)


def returns_none():
    return None


def returns_model():
    return _mlp()


def raises():
    raise RuntimeError("dataset not found")


def exits():
    sys.exit(0)


def exits_with_message():
    sys.exit("bye")


def exits_by_exit():
    exit(3)


def sequence_model(batch_size=2, seq_len=16):
    return gobrrr.Workload(model=_mlp(), batch=_x(batch_size), loss=_mse, seq_len=seq_len)
'''

EXIT_AT_IMPORT = """
import sys

sys.exit(0)


def workload():
    pass
"""

IMPORT_ERROR = """
import not_a_module_anyone_has


def workload():
    pass
"""

SYNTAX_ERROR = """
def workload(:
    pass
"""

GOOD_TOML = 'name = "mygpu"\nmemory_gb = 16\nbandwidth_gbs = 500\nbf16_tflops = 100\n'


def toml(**changes) -> str:
    """GOOD_TOML with keys replaced (value text as TOML writes it) or dropped (None)."""
    lines = dict(line.split(" = ", 1) for line in GOOD_TOML.strip().splitlines())
    for k, v in changes.items():
        if v is None:
            lines.pop(k, None)
        else:
            lines[k] = v
    return "".join(f"{k} = {v}\n" for k, v in lines.items())
