"""Measurement: real steps under torch.profiler, joined to the step graph; calibration."""

from gobrrr.profile.api import profile
from gobrrr.profile.calibrate import calibrate
from gobrrr.profile.compare import compare
from gobrrr.profile.result import ProfileResult
from gobrrr.profile.scaling import scaling

__all__ = ["ProfileResult", "calibrate", "compare", "profile", "scaling"]
