"""gobrrr: where the time and memory of a PyTorch training step go, on any GPU.

    import gobrrr
    est = gobrrr.estimate("gpt2", gpu="h100", batch=16, seq=1024)   # no GPU needed
    print(est.memory.peak, est.time.step_s)

Measuring on a GPU: `gobrrr.profile.profile`, `gobrrr.calibrate.api`.
"""

# first, before torch: a Ctrl-C while the `gobrrr` command imports is one line, exit 130
from gobrrr.cli.interrupt import install_early as _install_early

_install_early()

import functools as _functools  # noqa: E402
import logging as _logging  # noqa: E402

from gobrrr.errors import GobrrrError, check_choice, check_number  # noqa: E402
from gobrrr.estimate import Estimate, check_target_args, estimate  # noqa: E402
from gobrrr.evaluate import evaluate  # noqa: E402
from gobrrr.hardware import Target  # noqa: E402
from gobrrr.plan import search as _search  # noqa: E402
from gobrrr.plan.apply import apply  # noqa: E402
from gobrrr.plan.knobs import Knobs  # noqa: E402
from gobrrr.precision import PRECISIONS  # noqa: E402
from gobrrr.workload import Workload  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Estimate",
    "GobrrrError",
    "Knobs",
    "Target",
    "Workload",
    "__version__",
    "apply",
    "estimate",
    "evaluate",
    "plan",
]


@_functools.wraps(_search.plan)
def plan(source, gpu="h100", **kw):
    _check_plan_args(source, gpu, **kw)
    return _search.plan(source, gpu, **kw)


def _check_plan_args(
    source,
    gpu,
    *,
    global_batch=None,
    seq=None,
    precision="bf16-mixed",
    memory_budget=None,
    allow=(),
    margin=_search.MARGIN,
    calibration=True,
    gpus=1,
    nodes=1,
    progress=None,
) -> None:
    """`plan`'s arguments, checked before the workload is built (a TypeError for a name
    `plan` does not take, as Python raises)."""
    check_target_args(
        source, gpu, calibration, global_batch=global_batch, seq=seq, gpus=gpus, nodes=nodes
    )
    check_choice("precision", precision, PRECISIONS)
    if memory_budget is not None:
        check_number("memory_budget", memory_budget, 1, 2.0**60, "memory_budget=70 * 2**30")
    check_number("margin", margin, 0, 1, "margin=0.05")
    if isinstance(allow, str) or not all(isinstance(a, str) for a in allow):
        raise GobrrrError(
            f"allow={allow!r} is not a list of knob names",
            hint=f"give a list, e.g. allow=['compile'], of {', '.join(_search.ALLOW)}",
        )
    if progress is not None and not callable(progress):
        raise GobrrrError(
            f"progress={progress!r} is not callable", hint="give a function (done, total)"
        )


class _TorchaoEnumNotice(_logging.Filter):
    """torch's notice, logged once per process when torchao registers its enums as pytree
    constants ("... is an Enum subclass and is now natively supported"): torchao's business,
    not the user's. Other records of that logger pass."""

    def filter(self, record: _logging.LogRecord) -> bool:
        cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not str(getattr(cls, "__module__", "")).startswith("torchao")


_logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumNotice())
