"""Measurement: real steps under torch.profiler, joined to the step graph, compared with the
prediction."""

from gobrrr.profile.api import profile
from gobrrr.profile.compare import compare
from gobrrr.profile.result import ProfileResult
from gobrrr.profile.scaling import scaling

__all__ = ["ProfileResult", "compare", "profile", "scaling"]
