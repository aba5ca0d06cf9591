"""First contact, round two: each class of mistake a new user made is one line on stderr, exit
code 2 (130 for Ctrl-C, 141 for a closed pipe), no traceback, nothing half-written. One test
per class; the workloads are tiny so the file runs in seconds."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gobrrr
from gobrrr.capture import capture
from gobrrr.cli import main
from gobrrr.cli.app import BROKEN_PIPE, headroom
from gobrrr.cli.checks import explain
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import throughput_unit
from gobrrr.passes.accumulate import accumulate
from gobrrr.plan.search import divisors

SRC = Path(gobrrr.__file__).resolve().parents[1]
TINY = """
import os, sys, torch
from gobrrr import Workload

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 16)
        self.l = torch.nn.Linear(16, 16)
    def forward(self, x):
        os.write(1, b"written to fd 1\\n")
        sys.stdout.buffer.write(b"raw bytes\\n")
        print("a print")
        return self.l(self.emb(x))

def workload(batch_size: int = 2):
    sys.stdout.reconfigure(line_buffering=True)
    return Workload(model=M(), batch=(torch.randint(0, 100, (batch_size, 8)),),
                    loss=lambda out, b: out.float().mean())

def leaf_loss():
    return Workload(model=M(), batch=(torch.randint(0, 100, (2, 8)),),
                    loss=lambda out, b: torch.tensor(1.0, requires_grad=True))
"""


def one_error_line(err: str, *words: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gobrrr: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])


def _env() -> dict[str, str]:
    """This environment with the source tree first and gobrrr's debug mode off."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("GOBRRR_DEBUG", None)
    return env


def gobrrr_process(*argv: str, cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gobrrr", *argv], cwd=cwd, env=_env(), text=True, **kw
    )


# 1. numbers the command line cannot use; the divisor search of a huge global batch
@pytest.mark.parametrize(
    "argv, words",
    [
        (["plan", "--memory-budget", "inf"], ["--memory-budget", "finite size"]),
        (["plan", "--memory-budget", "nan"], ["--memory-budget", "finite size"]),
        (["plan", "--memory-budget", "1e400"], ["--memory-budget", "finite size"]),
        (["plan", "--memory-budget", "-5GiB"], ["--memory-budget"]),
        (["plan", "--margin", "nan"], ["--margin", "[0, 1)"]),
        (["plan", "--margin", "5"], ["--margin", "0.05 for 5%"]),
        (["plan", "--global-batch", "99999999999999"], ["--global-batch", "at most"]),
        (["estimate", "--batch", str(2**63)], ["--batch", "at most"]),
    ],
)
def test_numbers_out_of_reach_are_one_line(argv, words, capsys):
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, *words)


def test_divisors_of_a_huge_batch_in_a_blink():
    for n in (1, 2, 36, 97, 720):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    t0 = time.perf_counter()
    d = divisors(10**12)  # 2**12 * 5**12: 13 * 13 divisors
    assert len(d) == 169 and d[0] == 1 and d[-1] == 10**12 and d == sorted(d)
    assert time.perf_counter() - t0 < 2.0


# 2. Ctrl-C, early (importing torch) and late (tracing): one line, 130, nothing written
@pytest.mark.parametrize("delay_s", [0.4, 2.5])
def test_ctrl_c_is_one_line_and_exit_130(delay_s, tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    out = tmp_path / "graph.json"
    p = gobrrr_process(
        "estimate",
        "tiny.py:workload",
        "--json",
        "--save-graph",
        str(out),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    time.sleep(delay_s)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    if p.returncode == 0:  # the machine was faster than the delay: nothing to interrupt
        pytest.skip(f"finished within {delay_s} s")
    assert p.returncode == 130, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("gobrrr: error")]
    assert lines and lines[0].startswith("gobrrr: error: interrupted"), stderr
    assert "Traceback" not in stderr
    assert json.loads(stdout)["error"] == "interrupted"
    assert not out.exists()


def _python_m(code: str, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    """`code` run as `python -m` runs gobrrr (and torchrun runs it): the exit goes back
    through Py_RunMain, which is where CPython checks for an unhandled Ctrl-C."""
    (tmp_path / "as_module.py").write_text(code)
    return subprocess.run(
        [sys.executable, "-m", "as_module", *argv],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_caught_ctrl_c_inside_eval_still_exits_130(tmp_path):
    # CPython remembers a KeyboardInterrupt that went through eval/exec of a string (torch
    # evaluates annotations so while gobrrr traces) and kills itself by SIGINT at exit
    code = """if True:
        import sys
        from gobrrr.cli import interrupt
        def boom():
            raise KeyboardInterrupt
        try:
            eval("boom()")
        except KeyboardInterrupt:
            pass
        if "--forget" in sys.argv:
            interrupt.forget_unhandled()
        sys.exit(130)
    """
    assert _python_m(code, tmp_path).returncode == -signal.SIGINT  # as the command ended
    assert _python_m(code, tmp_path, "--forget").returncode == 130


def test_ctrl_c_after_the_output_is_committed_is_ignored(tmp_path):
    code = """if True:
        import os, signal, sys
        sys.argv[0] = "gobrrr"  # as the console script runs
        from gobrrr.cli import interrupt
        with interrupt.handling():
            interrupt.commit()
            os.kill(os.getpid(), signal.SIGINT)
            print("written whole", flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # in the teardown
        print("and the teardown too")
    """
    done = _python_m(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["written whole", "and the teardown too"]


# 3. the Python API checks its arguments where they enter
@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: gobrrr.estimate("mlp", batch="8"), ["batch='8'", "whole number"]),
        (lambda: gobrrr.estimate("mlp", gpu=3), ["gpu=3", "gpus=N"]),
        (lambda: gobrrr.estimate("mlp", checkpoint=True), ["checkpoint=True", "'full'"]),
        (
            lambda: gobrrr.estimate("mlp", compile="yes"),
            ["compile='yes'", "choose 'none', 'model', 'blocks'"],
        ),
        (lambda: gobrrr.estimate("mlp", seq=2.5), ["seq=2.5", "whole number"]),
        (lambda: gobrrr.estimate(3), ["source=3", "built-in model"]),
        (lambda: gobrrr.plan("mlp", global_batch="64"), ["global_batch='64'"]),
        (lambda: gobrrr.plan("mlp", margin=float("nan")), ["margin=nan", "[0, 1)"]),
        (lambda: gobrrr.plan("mlp", allow="compile"), ["allow='compile'", "['compile']"]),
        (lambda: gobrrr.plan("mlp", memory_budget="70GiB"), ["memory_budget='70GiB'"]),
    ],
)
def test_the_api_names_the_bad_argument(call, words):
    with pytest.raises(GobrrrError) as e:
        call()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# 4. a workload written for the GPU, a loss with no path to the parameters
def test_cuda_in_the_workload_and_a_leaf_loss(tmp_path, monkeypatch):
    moved = GobrrrError(
        "the traced step raised FakeTensorDeviceMismatchError: Expected all tensors to be on "
        "the same device, but found at least two devices, cpu and cuda:0!"
    )
    assert ".cuda()" in explain(moved)[1] and "remove" in explain(moved)[1]
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tiny4.py").write_text(TINY)
    import tiny4

    with pytest.raises(GobrrrError, match="made from scratch"):
        capture(tiny4.leaf_loss)


# 5. the user's writes to stdout never reach --json's stdout; a closed pipe is quiet
def test_user_writes_to_stdout_land_on_stderr(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    p = gobrrr_process(
        "estimate",
        "tiny.py:workload",
        "--json",
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    assert json.loads(stdout)["version"]  # the whole of stdout is one JSON object
    for text in ("written to fd 1", "raw bytes", "a print"):
        assert text in stderr


def test_a_closed_pipe_exits_141_quietly(tmp_path):
    p = gobrrr_process(
        "estimate",
        "--model",
        "mlp",
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()  # the reader went away (`gobrrr ... | head` once head has its lines)
    stderr = p.stderr.read()
    assert p.wait(timeout=120) == BROKEN_PIPE, stderr
    assert stderr.strip() == ""


# 6. profile and calibrate: checked before the work
def test_profile_without_gpu_and_calibrate_output_with_no_save(capsys):
    assert main(["calibrate", "--output", "cal.json", "--no-save"]) == 2
    one_error_line(capsys.readouterr().err, "--no-save", "drop")
    if torch.cuda.is_available():
        return
    t0 = time.perf_counter()
    assert main(["profile", "--model", "gpt2-xl", "--device", "cuda"]) == 2
    one_error_line(capsys.readouterr().err, "no CUDA GPU", "--device cpu")
    assert time.perf_counter() - t0 < 5  # gpt2-xl is not built first


# 7. one unit per result: an accumulated step of token inputs is still counted in tokens
def test_accumulated_token_steps_say_tokens(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tiny7.py").write_text(TINY)
    import tiny7

    g = capture(tiny7.workload)
    assert throughput_unit(g) == "tokens"
    assert throughput_unit(accumulate(g, 4)) == "tokens"


# 8. how close to the edge the chosen plan is, and the margin kept
def test_headroom_says_how_close_to_the_edge():
    gib = 2**30
    best = SimpleNamespace(headroom_bytes=gib // 10)
    r = SimpleNamespace(best=best, budget_bytes=24 * gib)
    h = headroom(r, 0.0)
    assert h["bytes"] == gib // 10 and h["share"] == pytest.approx(0.1 / 24) and h["at_edge"]
    assert "0.1 GiB of the 24.0 GiB" in h["says"] and "--margin 0.05" in h["says"]
    assert "no margin kept" in h["says"]
    roomy = headroom(
        SimpleNamespace(best=SimpleNamespace(headroom_bytes=6 * gib), budget_bytes=24 * gib), 0.2
    )
    assert not roomy["at_edge"] and "--margin 0.2 kept 20%" in roomy["says"]
    assert headroom(SimpleNamespace(best=None, budget_bytes=gib), 0.0) is None


# 9. torchao's pytree notice is dropped, other records of that logger kept
def test_torchaos_enum_notice_is_dropped(caplog):
    import enum

    class Mine(enum.Enum):
        A = 1

    class Theirs(enum.Enum):
        A = 1

    Theirs.__module__ = "torchao.quantization"
    log = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"):
        log.warning("%s is an Enum subclass and is now natively supported", Theirs)
        log.warning("%s is an Enum subclass and is now natively supported", Mine)
    assert [r.args[0] for r in caplog.records] == [Mine]


# 10. a directory as the workload file; compile with checkpointing worded as a fix
def test_a_directory_is_named_as_one(tmp_path, capsys):
    (tmp_path / "train.py").write_text(TINY)
    for spec in (str(tmp_path), f"{tmp_path}:workload"):
        assert main(["estimate", spec]) == 2
        one_error_line(capsys.readouterr().err, "is a directory", "train.py:workload")
    hint = explain(GobrrrError("the traced step raised: no rule ... run_and_save"))[1]
    assert "--compile with --checkpoint full" in hint
