"""Named passes over the step graph: each takes a StepGraph and returns a new one."""
