"""What reaches the terminal: gobrrr's output on stdout, everything else on stderr, library
noise that is not the user's business dropped, gobrrr's warnings one line each."""

import json
import logging
import os
import textwrap
import warnings
from pathlib import Path

import pytest

import gobrrr
from gobrrr.cli import main
from gobrrr.errors import GobrrrWarning
from gobrrr.report.streams import command_streams

PACKAGE = Path(gobrrr.__file__).parent


def printed_from(path: Path, text: str) -> None:
    exec(compile(f"print({text!r})", str(path), "exec"), {"__name__": path.stem})


def test_gobrrrs_prints_go_to_stdout_everyone_elses_to_stderr(capfd, tmp_path):
    with command_streams():
        printed_from(PACKAGE / "report" / "terminal.py", "a table")
        printed_from(tmp_path / "train.py", "the user's print")
    out, err = capfd.readouterr()
    assert out == "a table\n" and err == "the user's print\n"


def test_the_fake_tensor_loggers_traceback_is_dropped_other_records_kept(capfd):
    log = logging.getLogger("torch._subclasses.fake_tensor")
    with command_streams():
        try:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        except RuntimeError:
            log.exception("failed while attempting to run meta for %s", "aten.mm.default")
        log.error("something the user should see")
    err = capfd.readouterr().err
    assert "failed while attempting" not in err and "Traceback" not in err
    assert "something the user should see" in err


def test_noise_warnings_are_dropped_real_ones_kept_gobrrrs_on_one_line(capfd, monkeypatch):
    shown = []  # where other warnings go: Python's display, here recorded
    monkeypatch.setattr(warnings, "showwarning", lambda m, *a, **k: shown.append(str(m)))
    with command_streams() as said:
        warnings.warn(
            "Accessing the data pointer of FakeTensor is deprecated and will error",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn("your learning rate schedule is odd", UserWarning, stacklevel=1)
        warnings.warn("--seq 8 is not used:\n mlp takes none", GobrrrWarning, stacklevel=1)
    err = capfd.readouterr().err
    assert shown == ["your learning rate schedule is odd"]
    assert err == "gobrrr: warning: --seq 8 is not used: mlp takes none\n"
    assert said == ["--seq 8 is not used: mlp takes none"]


HF_WORKLOAD = textwrap.dedent("""
    import torch
    import transformers as tf

    import gobrrr

    def workload(batch_size=2, seq_len=16):
        cfg = tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                            bos_token_id=0, eos_token_id=0)
        model = tf.AutoModelForCausalLM.from_config(cfg)
        ids = torch.randint(0, 64, (batch_size, seq_len))
        return gobrrr.Workload(model=model, batch={"input_ids": ids, "labels": ids},
                               seq_len=seq_len)
""")


def test_transformers_loss_type_notice_is_dropped(capfd, tmp_path, monkeypatch):
    pytest.importorskip("transformers", exc_type=ImportError)
    (tmp_path / "hf.py").write_text(HF_WORKLOAD)
    monkeypatch.chdir(tmp_path)
    clear = getattr(logging.Logger, "warning_once", None)
    # the notice is real: outside gobrrr's command it is printed
    import importlib.util

    # transformers' handler writes to the sys.stderr of the moment it was made (pytest's own
    # capture, when another test module imported transformers first): point it at file
    # descriptor 2, which capfd reads, for this test
    from transformers.utils import logging as hf_logging

    fd2 = os.fdopen(os.dup(2), "w", buffering=1)
    for h in hf_logging._get_library_root_logger().handlers:
        if type(h) is logging.StreamHandler:  # transformers' own, not pytest's capture
            monkeypatch.setattr(h, "stream", fd2)
    spec = importlib.util.spec_from_file_location("hf_direct", tmp_path / "hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    clear.cache_clear()
    w = module.workload()
    w.compute_loss(w.batch)
    assert "loss_type" in capfd.readouterr().err
    clear.cache_clear()
    code = main(["estimate", "hf.py:workload", "--json", "--gpu", "a100"])
    out, err = capfd.readouterr()
    assert code == 0 and err == "", err
    assert json.loads(out)["workload"]["tokens"] == 32


def test_under_json_the_warnings_are_in_the_output_too(capfd):
    code = main(["estimate", "--model", "mlp", "--batch", "2", "--seq", "9", "--json"])
    out, err = capfd.readouterr()
    assert code == 0 and err.startswith("gobrrr: warning: --seq 9 is not used")
    assert json.loads(out)["warnings"] == [err.removeprefix("gobrrr: warning: ").strip()]


def test_an_error_under_json_is_a_json_object(capfd):
    code = main(["estimate", "--model", "gpt-2", "--json"])
    out, err = capfd.readouterr()
    data = json.loads(out)
    assert code == 2 and data["version"] == 1
    assert data["error"] == "unknown model 'gpt-2' (did you mean 'gpt2'?)"
    assert data["hint"].startswith("choose one of gpt2,")
    assert err == f"gobrrr: error: {data['error']}: {data['hint']}\n"
