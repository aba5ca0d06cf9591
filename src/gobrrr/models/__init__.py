"""Built-in workloads: GPT-2 and Llama-3 families, the lecture's deep MLP, a small ConvNet."""

from gobrrr.models.registry import describe, get_workload, load_workload, model_names

__all__ = ["describe", "get_workload", "load_workload", "model_names"]
