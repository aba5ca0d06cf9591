"""The command line: thin over the API; bad input is one line and exit code 2."""

import json
import textwrap

import pytest

from gobrrr.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json_on_a_small_builtin(capsys):
    code, out, err = run(
        capsys,
        "estimate",
        "--model",
        "gpt2",
        "--batch",
        "1",
        "--seq",
        "64",
        "--gpu",
        "a100",
        "--json",
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["gpu"]["name"] == "a100-80gb"
    assert data["workload"]["tokens"] == 64
    assert data["workload"]["params"] == 124_439_808
    assert data["memory"]["fits"] is True and data["memory"]["peak_bytes"] > 0
    assert 0 < data["time"]["mfu"] < 1
    assert data["formulas"]["params_textbook_12d2L_2dV"] == 12 * 768**2 * 12 + 2 * 768 * 50257


def test_estimate_tables_and_saved_graph(capsys, tmp_path):
    path = tmp_path / "g.json"
    code, out, err = run(
        capsys, "estimate", "--model", "mlp", "--batch", "8", "--save-graph", str(path)
    )
    assert code == 0, err
    assert "peak memory" in out and "top" in out
    from gobrrr.graph.ir import StepGraph

    assert len(StepGraph.load(path).nodes) > 10


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["estimate", "--model", "gpt5"], "unknown model 'gpt5'"),
        (["estimate", "--model", "gpt2", "--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["estimate", "--model", "gpt2", "--batch", "0"], "batch"),
        (["estimate", "--model", "gpt2", "--seq", "4096"], "1024"),
        (["estimate", "--model", "gpt2", "--precision", "fp8"], "unknown precision"),
        (["estimate", "--model", "gpt2", "--checkpoint", "some"], "checkpoint"),
        (["estimate", "nowhere.py:workload"], "nowhere.py"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("gobrrr: error:")
    assert needle in err


def test_user_script_that_raises(capsys, tmp_path):
    f = tmp_path / "train.py"
    f.write_text(
        textwrap.dedent("""
        def workload(batch_size=2):
            raise RuntimeError("dataset not found")
    """)
    )
    code, out, err = run(capsys, "estimate", f"{f}:workload")
    assert code == 2 and "dataset not found" in err and err.count("\n") == 1


def test_user_script_with_dataclasses_and_a_sibling_module(capsys, tmp_path):
    # the file imports as `python train.py` would: a module beside it imports, and a
    # @dataclass (which looks its module up in sys.modules) works
    (tmp_path / "mlp_parts.py").write_text("WIDTH = 24\n")
    f = tmp_path / "train.py"
    f.write_text(
        textwrap.dedent("""
        from dataclasses import dataclass

        import torch
        import gobrrr
        from mlp_parts import WIDTH

        @dataclass(frozen=True)
        class Config:
            width: int = WIDTH

        def workload(batch_size=4):
            c = Config()
            model = torch.nn.Sequential(torch.nn.Linear(c.width, c.width), torch.nn.ReLU(),
                                        torch.nn.Linear(c.width, 1))
            x = torch.randn(batch_size, c.width)
            return gobrrr.Workload(model=model, batch=(x,), loss=lambda y, b: y.square().mean(),
                                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    """)
    )
    code, out, err = run(capsys, "estimate", f"{f}:workload", "--json", "--gpu", "a100")
    assert code == 0, err
    assert json.loads(out)["workload"]["params"] == 24 * 24 + 24 + 24 + 1


def test_user_gpu_file(capsys, tmp_path):
    f = tmp_path / "mygpu.toml"
    f.write_text('name = "mygpu"\nmemory_gb = 16\nbandwidth_gbs = 500\nbf16_tflops = 100\n')
    code, out, err = run(
        capsys, "estimate", "--model", "mlp", "--batch", "4", "--gpu", str(f), "--json"
    )
    assert code == 0, err
    assert json.loads(out)["gpu"]["name"] == "mygpu"


def test_gpus_lists_every_builtin(capsys):
    code, out, err = run(capsys, "gpus", "--json")
    data = json.loads(out)
    assert data["version"] == 1
    names = {g["name"] for g in data["gpus"]}
    assert {
        "a100-40gb",
        "a100-80gb",
        "h100-sxm",
        "h100-pcie",
        "h200",
        "b200",
        "l4",
        "l40s",
        "rtx4090",
    } <= names


def test_debug_shows_the_traceback_and_still_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("GOBRRR_DEBUG", "1")
    code, out, err = run(capsys, "estimate", "--model", "gpt5")
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1].startswith("gobrrr: error: unknown model 'gpt5'")


def test_hints_name_the_misaligned_head_and_what_does_not_fit(capsys):
    code, out, err = run(
        capsys, "estimate", "--model", "gpt2", "--batch", "2", "--seq", "128", "--json"
    )
    hints = json.loads(out)["hints"]
    assert any("50257" in h and "lm_head" in h for h in hints)
    code, out, err = run(capsys, "estimate", "--model", "llama3-8b", "--seq", "128", "--json")
    data = json.loads(out)
    assert data["memory"]["fits"] is False  # 8B params: weights+grads+AdamW > 80 GB
    assert any("optimizer states alone" in h for h in data["hints"])


def test_unwritable_graph_path_is_one_line(capsys, tmp_path):
    target = tmp_path / "missing-dir" / "g.json"
    code, out, err = run(
        capsys, "estimate", "--model", "mlp", "--batch", "4", "--save-graph", str(target)
    )
    assert code == 2 and err.startswith("gobrrr: error: --save-graph")
    assert "does not exist" in err and "mkdir -p" in err and err.count("\n") == 1
    assert not target.parent.exists()
