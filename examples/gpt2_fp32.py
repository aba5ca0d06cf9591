"""GPT-2 (124M) meant to be run in true fp32 (TF32 off): its matmuls miss the tensor cores.

gobrrr profile examples/gpt2_fp32.py:workload --precision fp32
"""

from gobrrr import Workload
from gobrrr.models.registry import get_workload


def workload(batch_size: int | None = None, seq_len: int | None = None) -> Workload:
    """GPT-2 124M, batch 4 and sequence 1024 unless given."""
    return get_workload("gpt2", batch_size=batch_size or 4, seq_len=seq_len or 1024)
