"""Where a step's time goes, seen from the notebook: ``sess.profile(steps=N)`` (a deep look
with torch.profiler on every rank, merged into one trace)."""

from .step_profile import SessionProfiling, StepProfile

__all__ = ["SessionProfiling", "StepProfile"]
