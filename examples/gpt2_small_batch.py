"""GPT-2 (124M) at a small batch: the step is overhead-bound on an H100 in eager mode.

gobrrr profile examples/gpt2_small_batch.py:workload --batch 1 --seq 256 --scaling
"""

from gobrrr import Workload
from gobrrr.models.registry import get_workload


def workload(batch_size: int | None = None, seq_len: int | None = None) -> Workload:
    """GPT-2 124M, batch 1 and sequence 256 unless given."""
    return get_workload("gpt2", batch_size=batch_size or 1, seq_len=seq_len or 256)
