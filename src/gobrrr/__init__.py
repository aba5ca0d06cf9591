"""gobrrr: where the time and memory of a PyTorch training step go, on any GPU."""

from gobrrr.errors import GobrrrError
from gobrrr.workload import Workload

__version__ = "0.1.0"

__all__ = ["GobrrrError", "Workload", "__version__"]
