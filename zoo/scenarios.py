"""The planner's measured scenarios (benchmarks/plan/bench_plan.py ran them on an H100), the
workloads among them that are not gobrrr built-ins (as "file.py:function" specs taking
batch_size, as `gobrrr plan` needs), and their configurations costed again on the CPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
if str(HERE.parents[1]) not in sys.path:  # loaded by path, as a "file.py:function" spec
    sys.path.insert(0, str(HERE.parents[1]))

from gobrrr.models.registry import get_workload  # noqa: E402
from gobrrr.plan.knobs import Knobs  # noqa: E402
from gobrrr.plan.search import Planner  # noqa: E402
from zoo.vision import torchvision_model  # noqa: E402

#: name -> (workload source, seq, global batch, precision[, allow, grid]). Sources are
#: built-in names or "file.py:function" specs taking batch_size (and seq_len). allow: what
#: `--allow` gives the planner; grid: "all" (default) or "least" (only the grid's
#: least-memory point, micro-batch 1 with every block checkpointed: where the prediction says
#: the whole grid runs out of memory, one run shows it).
SCENARIOS: dict[str, tuple] = {
    "llama3-1b-seq16k": ("llama3-1b", 16384, 4, "bf16-mixed"),
    "llama3-3b-seq4k": ("llama3-3b", 4096, 8, "bf16-mixed"),
    "resnet50-cl-b2048": (f"{HERE}:resnet50", None, 2048, "bf16-mixed"),
    "gpt2-xl-seq1k": ("gpt2-xl", 1024, 32, "bf16-mixed"),
    "vit-l16-b512": (f"{HERE}:vit_l_16", None, 512, "bf16-mixed"),
    "llama-5b-seq4k-states": (
        f"{HERE}:llama_5b",
        4096,
        8,
        "bf16-mixed",
        ("8bit-states", "offload"),
        "least",
    ),
}


def resnet50(batch_size: int = 256, seq_len: int | None = None):
    """torchvision ResNet-50, channels_last, 224 x 224 images, cross-entropy, AdamW."""
    return torchvision_model(batch_size, None, arch="resnet50", channels_last=True)


def vit_l_16(batch_size: int = 256, seq_len: int | None = None):
    """torchvision ViT-L/16 (304M parameters), 224 x 224 images, cross-entropy, AdamW."""
    return torchvision_model(batch_size, None, arch="vit_l_16")


def llama_5b(batch_size: int = 8, seq_len: int = 4096):
    """Llama-3 8B's layer shape (dim 4096, GQA 32/8 heads, SwiGLU 14336, 128256-token vocab,
    untied head) at 20 layers: 5.4B parameters, whose fp32 weights, gradients and AdamW
    states (16 bytes a parameter, 86 GB) alone exceed an 80 GB GPU: nothing fits at the
    user's numerics; 8-bit states or offloaded states make it fit."""
    return get_workload("llama3-8b", batch_size, seq_len, n_layer=20)


def repredict(path: Path, names: list[str] | None = None) -> list[dict]:
    """Every configuration a plan_h100_*.json run measured (of the scenarios `names`, or all),
    costed again by `Planner.cost` beside the measurement and the recorded prediction.
    Errors are predicted / measured - 1; step times in seconds."""
    data = json.loads(path.read_text())
    rows = []
    for name, sc in data["scenarios"].items():
        if names and name not in names:
            continue
        source, seq, g, precision, *rest = SCENARIOS[name]
        allow = rest[0] if rest else ()
        t = time.perf_counter()
        planner = Planner(source, "h100", global_batch=g, seq=seq, precision=precision, allow=allow)
        for c in sc["configs"]:
            m = c["measured"]
            if "step_s" not in m:
                continue
            now = planner.cost(Knobs.from_dict(c["knobs"]))
            rows.append(
                {
                    "file": path.name,
                    "scenario": name,
                    "role": c["role"],
                    "changes": c["changes"],
                    "measured_step_s": m["step_s"],
                    "recorded_step_s": c["predicted"]["step_s"],
                    "predicted_step_s": now.step_s,
                    "step_err": now.step_s / m["step_s"] - 1,
                    "recorded_step_err": c["predicted"]["step_s"] / m["step_s"] - 1,
                    "units_per_s_err": m["step_s"] / now.step_s - 1,
                    "alloc_err": now.peak_bytes / m["peak_allocated"] - 1,
                    "reserved_err": now.reserved_bytes / m["peak_reserved"] - 1,
                }
            )
        print(f"{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return rows
