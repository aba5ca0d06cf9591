"""gobrrr: where the time and memory of a PyTorch training step go, on any GPU.

    import gobrrr
    est = gobrrr.estimate("gpt2", gpu="h100", batch=16, seq=1024)   # no GPU needed
    print(est.memory.peak, est.time.step_s)

Measuring on a GPU: `gobrrr.profile.profile`, `gobrrr.calibrate.api`.
"""

from gobrrr.errors import GobrrrError
from gobrrr.estimate import Estimate, estimate
from gobrrr.evaluate import evaluate
from gobrrr.hardware import Target
from gobrrr.plan.apply import apply
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.search import plan
from gobrrr.workload import Workload

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
