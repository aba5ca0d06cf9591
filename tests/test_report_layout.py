"""Terminal output fits 80 columns and a pipe; names are wrapped, never cut; cut lists say so;
the header says what the trace saw."""

import io
import re

import pytest
import torch
from rich.console import Console
from torch import nn
from torch.utils.checkpoint import checkpoint

import gobrrr
from gobrrr.hardware import BUILTIN_GPUS
from gobrrr.report.estimate import estimate_dict
from gobrrr.report.terminal import op_label, print_estimate, print_gpus, summary_lines

LONG = "a_module_name_far_too_long_for_any_column_of_an_eighty_column_table"
STACK = "an_encoder_stack_whose_name_alone_takes_most_of_a_line"


class Deep(nn.Module):
    """Modules with long names, two levels deep; checkpoints its blocks when asked."""

    def __init__(self, ckpt: bool = False):
        super().__init__()
        self.ckpt = ckpt
        inner = nn.ModuleDict({LONG: nn.Linear(32, 32), "short": nn.Linear(32, 32)})
        self.add_module(STACK, nn.ModuleDict({"encoder_block_with_a_long_name": inner}))

    def forward(self, x):
        inner = getattr(self, STACK)["encoder_block_with_a_long_name"]
        for m in inner.values():
            x = checkpoint(m, x, use_reentrant=False) if self.ckpt else m(x)
        return x.square().mean()


def render(fn, *args, **kw) -> str:
    buf = io.StringIO()
    fn(*args, console=Console(file=buf, width=80, color_system=None), **kw)
    return buf.getvalue()


def whole(text: str, name: str) -> bool:
    """Whether `name` reads in full down one column of `text`: its first piece somewhere on a
    line, the rest wrapped or folded onto the lines below at the same position."""
    target = name.replace(" ", "")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        for start in re.finditer(re.escape(name[:5]), line):
            got = ""
            for below in lines[i:]:
                got += below[start.start() :].split("  ")[0].replace(" ", "")
                if len(got) >= len(target):
                    break
            if got == target:
                return True
    return False


@pytest.fixture(scope="module")
def est():
    return gobrrr.estimate(lambda: gobrrr.Workload(model=Deep(), batch=torch.randn(4, 32)), "h100")


def test_everything_fits_80_columns_and_nothing_is_cut(est):
    text = render(print_estimate, est, top=50)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text and "..." not in text


def test_long_names_wrap_in_their_column(est):
    text = render(print_estimate, est, top=50)
    module = f"{STACK}.encoder_block_with_a_long_name.{LONG}"
    assert module in est.time.by_module(depth=9) and len(module) > 80
    mm = next(o for o in est.time.ops if o.module == module and o.device_s > 0)
    assert whole(text, f"#{mm.index} in {module}")
    # the modules table, two levels deep: longer than its column
    assert whole(text, f"{STACK}.encoder_block_with_a_long_name")


def test_cut_lists_say_so_and_how_to_see_all(est):
    timed = sum(1 for o in est.time.ops if o.device_s > 0)
    text = render(print_estimate, est, top=3)
    assert f"Top 3 of {timed} ops by predicted time (--top N for more" in text
    assert len(estimate_dict(est, top=3)["top_ops"]) == 3 and estimate_dict(est)["ops"] == len(
        est.graph.nodes
    )
    assert f"{timed} ops by predicted time" in render(print_estimate, est, top=10_000)


def test_gpus_shows_every_name_and_alias():
    text = render(print_gpus)
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    for g in BUILTIN_GPUS:
        assert whole(text, g.name)
        for a in g.aliases:
            assert a in text


def test_the_header_says_the_model_checkpoints_itself():
    est = gobrrr.estimate(
        lambda: gobrrr.Workload(model=Deep(ckpt=True), batch=torch.randn(4, 32)), "h100"
    )
    header = str(summary_lines(est)[0])
    assert "checkpoint by the model itself" in header and "ops recomputed" in header
    assert estimate_dict(est)["workload"]["checkpointing"] == "model"


def test_the_units_are_the_workloads():
    cnn = gobrrr.estimate("convnet", "h100", batch=2)
    lines = " ".join(str(x) for x in summary_lines(cnn))
    assert "2 samples/step" in lines and "samples/s" in lines and "tokens" not in lines
    d = estimate_dict(cnn)["time"]
    assert d["unit"] == "samples" and "tokens_per_s" not in d
    assert d["per_s"] == pytest.approx(2 / d["step_s"])


def test_mfu_states_its_peak_and_the_6n_convention_is_labelled():
    est = gobrrr.estimate("gpt2", "h100", batch=1, seq=64)
    step = str(summary_lines(est)[2])
    assert "of the bf16 peak (989 TFLOP/s)" in step
    text = render(print_estimate, est)
    assert "6·N·T + attention (PaLM" in text
    t = estimate_dict(est)["time"]
    assert t["mfu"] <= t["hfu"] and "mfu_6n_attention" in t and t["peak_flops"] == 989.4e12
    f = est.formulas  # the traced parameters close the textbook's gap exactly
    assert (
        f["params_textbook_12d2L_2dV"] + sum(d for _, d in f["params_gap"])
        == f["params_traced"]
        == 124_439_808
    )
    assert "head tied to the embedding" in text


def test_op_labels_are_abbreviated_one_way():
    assert op_label("aten.mm.default") == "mm"
    assert op_label("aten.add.Tensor") == "add.Tensor"
    assert op_label("gobrrr.rms_norm_fwd.default") == "gobrrr.rms_norm_fwd"
