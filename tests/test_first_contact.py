"""First contact: bad or unusual input as a new user types it, through the command line.

Every case asserts the exit code, exactly one line on stderr and no traceback, the words that
name the problem and the fix, and under --json that stdout is one JSON object (with "error"
and "hint" when the command failed). `benchmarks/cli/first_contact_corpus.py` runs this corpus
against another version of gobrrr to count how many cases it passes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import pytest
from first_contact_files import (
    BAD_WORKLOADS,
    EXIT_AT_IMPORT,
    GOOD_TOML,
    IMPORT_ERROR,
    SYNTAX_ERROR,
    toml,
)

from gobrrr.cli import main


@dataclass(frozen=True)
class Case:
    """One command line. `words`: substrings (any case) stderr must contain; `files`:
    written into the working directory first (a name ending in / is a directory)."""

    id: str
    argv: tuple[str, ...]
    words: tuple[str, ...]
    code: int = 2
    files: dict[str, str] = field(default_factory=dict)


def wl(fn: str, *words: str, code: int = 2, json_out: bool = False, extra=()) -> Case:
    """A case running `estimate bad.py:fn` on the file of workload mistakes."""
    argv = ("estimate", f"bad.py:{fn}", *extra) + (("--json",) if json_out else ())
    return Case(
        f"workload-{fn}" + ("-json" if json_out else ""),
        argv,
        words,
        code,
        {"bad.py": BAD_WORKLOADS},
    )


def gpu(id: str, text: str, *words: str, name: str = "g.toml") -> Case:
    files = {name: text} if not name.endswith("/") else {name: ""}
    return Case(
        f"gpu-{id}",
        ("estimate", "--model", "mlp", "--batch", "2", "--gpu", name.rstrip("/")),
        words,
        2,
        files,
    )


def cli(id: str, argv: str, *words: str, code: int = 2, files=None) -> Case:
    return Case(f"cli-{id}", tuple(argv.split()), words, code, files or {})


WORKLOAD_CASES = [
    wl("opt_instance", "optimizer", "instance of SGD", "lambda params"),
    wl("opt_instance", "optimizer", "factory", json_out=True),
    wl("opt_string", "optimizer='adamw'", "factory", "lambda params"),
    wl("opt_int", "optimizer=3", "factory"),
    wl("opt_returns_none", "returned NoneType", "must return the optimizer"),
    wl("opt_returns_none", "not a torch.optim.Optimizer", json_out=True),
    wl("opt_no_arg", "optimizer(params)", "take the parameters"),
    wl("opt_bad_lr", "Invalid learning rate", "optimizer(params)"),
    wl("model_none", "model=None", "nn.Module"),
    wl("model_none", "model=None", json_out=True),
    wl("model_function", "function", "wrap it in an nn.Module"),
    wl("model_class", "is the class", "model=Linear(...)"),
    wl("model_string", "model='gpt2'", "nn.Module"),
    wl("model_frozen", "no trainable parameters", "requires_grad"),
    wl("model_no_params", "no trainable parameters", "parameters to train"),
    wl("batch_none", "batch=None", "tensor"),
    wl("batch_numpy", "numpy", "torch.from_numpy(batch[0])"),
    wl("batch_numpy_in_dict", "batch['x']", "torch.from_numpy"),
    wl("batch_no_tensor", "holds no tensor", "tensors"),
    wl("batch_inputs_and_labels", "model(*batch) with 2 arguments", "step=lambda model, batch"),
    wl("batch_inputs_and_labels", "model(*batch)", json_out=True),
    wl("batch_wrong_keys", "model(**batch) with keys inputs", "forward(x)"),
    wl("loss_float", "returned 1.0", "scalar tensor"),
    wl("loss_float", "not a loss tensor", json_out=True),
    wl("loss_not_scalar", "shape (4, 1)", ".mean()"),
    wl("loss_detached", "does not depend on the model's parameters", ".detach()"),
    wl("loss_string", "loss='mse'", "loss(output, batch)"),
    wl("loss_one_arg", "loss(output, batch)", "two arguments"),
    wl("loss_on_whole_batch", "loss(output, batch)", "batch[1]"),
    wl("loss_and_step", "both loss= and step=", "give one"),
    wl("step_not_callable", "step='train'", "step(model, batch)"),
    wl("step_one_arg", "step(model, batch)", "two arguments"),
    wl("step_returns_float", "Workload(step=...) returned 0.5", "scalar tensor"),
    wl("step_returns_dict", "Workload(step=...) returned", "scalar tensor"),
    wl("model_returns_vector", "shape (4, 1)", ".mean()"),
    wl("model_returns_none", "the model returned None", "Workload(loss="),
    wl("model_returns_string", "the model returned 'loss'", "Workload(loss="),
    wl("tokens_negative", "tokens=-3", "int > 0"),
    wl("tokens_float", "tokens=2.5", "int > 0"),
    wl("seq_len_zero", "seq_len=0", "int > 0"),
    wl("name_number", "name=3", "string"),
    wl("info_list", "info=", "dict"),
    wl("numpy_in_forward", "numpy", "torch ops"),
    wl("numpy_in_forward", "numpy", json_out=True),
    wl("item_in_forward", "reads a tensor's value", ".item()"),
    wl("tolist_in_forward", "reads a tensor's value", "torch.where"),
    wl("shape_mismatch", "same reduction dim", "plain PyTorch"),
    wl("shape_mismatch", "same reduction dim", json_out=True),
    wl("returns_none", "returned NoneType", "return Workload("),
    wl("returns_model", "returned Sequential", "return Workload("),
    wl("raises", "dataset not found", "plain Python"),
    wl("raises", "dataset not found", json_out=True),
    wl("exits", "sys.exit(0)", "__main__"),
    wl("exits", "sys.exit(0)", json_out=True),
    wl("exits_with_message", "sys.exit('bye')", "remove the exit"),
    wl("exits_by_exit", "sys.exit(3)", "remove the exit"),
    wl("no_such_function", "has no function 'no_such_function'", "functions:"),
    wl("print_in_forward", "hello from forward", code=0, json_out=True),
    wl("print_while_building", "building the model", code=0, json_out=True),
    wl("no_args", "--batch 8 is not used", "batch_size", code=0, extra=("--batch", "8")),
    wl("good", "--seq 64 is not used", "seq_len", code=0, extra=("--seq", "64")),
    wl("good", "--seq 64 is not used", code=0, json_out=True, extra=("--seq", "64")),
    Case(
        "workload-exit-at-import",
        ("estimate", "ex.py:workload"),
        ("sys.exit(0)", "__main__"),
        2,
        {"ex.py": EXIT_AT_IMPORT},
    ),
    Case(
        "workload-import-error",
        ("estimate", "imp.py:workload"),
        ("No module named 'not_a_module_anyone_has'", "plain Python"),
        2,
        {"imp.py": IMPORT_ERROR},
    ),
    Case(
        "workload-syntax-error",
        ("estimate", "syn.py:workload"),
        ("SyntaxError", "plain Python"),
        2,
        {"syn.py": SYNTAX_ERROR},
    ),
    Case(
        "workload-file-missing", ("estimate", "nowhere.py:workload"), ("nowhere.py", "not found"), 2
    ),
    Case(
        "workload-no-function-named",
        ("estimate", "bad.py"),
        ("path/to/file.py:function",),
        2,
        {"bad.py": BAD_WORKLOADS},
    ),
    Case(
        "workload-not-python",
        ("estimate", "notes.txt:workload"),
        ("notes.txt", ".py"),
        2,
        {"notes.txt": "hello"},
    ),
]

GPU_CASES = [
    gpu("bool", toml(bf16_tflops="true"), "bf16_tflops", "bool", "number > 0"),
    gpu("inf", toml(bf16_tflops="inf"), "bf16_tflops is inf", "finite number"),
    gpu("minus-inf", toml(memory_gb="-inf"), "memory_gb is -inf", "finite number"),
    gpu("nan", toml(bandwidth_gbs="nan"), "bandwidth_gbs is nan", "finite number"),
    gpu(
        "nan-json",
        '{"name": "x", "memory_gb": 16, "bandwidth_gbs": 500, "bf16_tflops": NaN}',
        "bf16_tflops is nan",
        "finite number",
        name="g.json",
    ),
    gpu(
        "huge-json",
        '{"name": "x", "memory_gb": 1e400, "bandwidth_gbs": 500, "bf16_tflops": 100}',
        "memory_gb is inf",
        "finite number",
        name="g.json",
    ),
    gpu("negative", toml(memory_gb="-16"), "memory_gb is -16", "> 0"),
    gpu("zero", toml(bandwidth_gbs="0"), "bandwidth_gbs is 0", "> 0"),
    gpu(
        "string-with-unit",
        toml(memory_gb='"80 GB"'),
        "memory_gb is '80 GB'",
        "without quotes or units",
    ),
    gpu("quoted-number", toml(bf16_tflops='"100"'), "bf16_tflops is '100'", "without quotes"),
    gpu("list", toml(bf16_tflops="[100, 200]"), "bf16_tflops is [100, 200]", "number > 0"),
    gpu("table", GOOD_TOML + "[fp8]\ntflops = 1\n", "unknown key 'fp8'", "the keys are"),
    gpu(
        "typo",
        GOOD_TOML + "bandwith_gbs = 3\n",
        "unknown key 'bandwith_gbs'",
        "did you mean 'bandwidth_gbs'",
    ),
    gpu("typo-tflops", GOOD_TOML + "fp32_tflop = 3\n", "did you mean 'fp32_tflops'"),
    gpu("unknown-key", GOOD_TOML + "colour = 'green'\n", "unknown key 'colour'", "the keys are"),
    gpu(
        "missing",
        toml(bandwidth_gbs=None, bf16_tflops=None),
        "lacks bandwidth_gbs, bf16_tflops",
        "GB/s",
    ),
    gpu("empty", "", "lacks name", "add name"),
    gpu("bad-toml", "name = mygpu\n", "not valid TOML", "keys name"),
    gpu("bad-json", '{"name": "x",}', "not valid JSON", "keys name", name="g.json"),
    gpu("json-list", "[1, 2]", "holds a list", "name", name="g.json"),
    gpu("sms-fraction", toml(sms="1.5"), "sms is 1.5", "whole number"),
    gpu("sms-bool", toml(sms="false"), "sms is False", "whole number"),
    gpu("sms-zero", toml(sms="0"), "sms is 0", "whole number > 0"),
    gpu("name-empty", toml(name='""'), "name is ''", "quoted string"),
    gpu("name-number", toml(name="5"), "name is 5", "quoted string"),
    gpu("fp16-zero", toml(fp16_tflops="0"), "fp16_tflops is 0", "> 0"),
    gpu("launch-negative", toml(launch_overhead_us="-2"), "launch_overhead_us is -2", "> 0"),
    gpu("directory", "", "is a directory", ".toml or .json file", name="specs.toml/"),
    gpu("directory-plain", "", "is a directory", "GPU name", name="specs/"),
    gpu("yaml", "name: x\n", "must end in .toml or .json", "rename it", name="g.yaml"),
    Case(
        "gpu-missing-file",
        ("estimate", "--model", "mlp", "--gpu", "none.toml"),
        ("none.toml", "No such file"),
        2,
    ),
    cli("gpu-typo", "estimate --model mlp --gpu h10", "unknown GPU 'h10'", "did you mean 'h100'"),
    cli("gpu-typo-sxm", "estimate --model mlp --gpu h100-sx", "did you mean 'h100-sxm'"),
    cli("gpu-spaced", "estimate --model mlp --gpu rtx_4090", "did you mean 'rtx4090'"),
    cli("gpu-unknown", "estimate --model mlp --gpu tpu", "unknown GPU 'tpu'", "gobrrr gpus"),
    cli("gpu-unknown-json", "estimate --model mlp --gpu tpu --json", "unknown GPU"),
]

ARGUMENT_CASES = [
    cli(
        "seq-for-mlp",
        "estimate --model mlp --batch 2 --seq 128",
        "--seq 128 is not used",
        "not a sequence model",
        code=0,
    ),
    cli(
        "seq-for-mlp-json",
        "estimate --model mlp --batch 2 --seq 128 --json",
        "--seq 128 is not used",
        code=0,
    ),
    cli(
        "seq-for-convnet",
        "estimate --model convnet --batch 1 --seq 64",
        "--seq 64 is not used",
        "drop --seq",
        code=0,
    ),
    cli("model-empty", "estimate --model=", "--model is empty", "gpt2"),
    cli("model-empty-json", "estimate --model= --json", "--model is empty"),
    Case(
        "cli-model-spaces", ("estimate", "--model", "  "), ("--model is empty", "file.py:function")
    ),
    cli("model-typo", "estimate --model gpt-2", "unknown model 'gpt-2'", "did you mean 'gpt2'"),
    cli("model-case", "estimate --model GPT2", "did you mean 'gpt2'"),
    cli("model-typo-llama", "estimate --model llama3-8", "did you mean 'llama3-8b'"),
    cli(
        "model-unknown", "estimate --model resnet50", "unknown model 'resnet50'", "file.py:function"
    ),
    cli("model-typo-json", "estimate --model gpt-2 --json", "did you mean 'gpt2'"),
    cli("model-and-file", "estimate a.py:f --model gpt2", "not both"),
    cli("seq-zero", "estimate --model gpt2 --seq 0", "--seq", "positive whole number"),
    cli("batch-zero", "estimate --model gpt2 --batch 0", "--batch", "positive whole number"),
    cli("batch-negative", "estimate --model gpt2 --batch -1", "--batch", "positive whole number"),
    cli("batch-word", "estimate --model gpt2 --batch abc", "'abc'", "positive whole number"),
    cli("batch-fraction", "estimate --model gpt2 --batch 1.5", "'1.5'", "whole number"),
    cli("batch-word-json", "estimate --model gpt2 --batch abc --json", "positive whole number"),
    cli("seq-word", "estimate --model gpt2 --seq long", "'long'", "positive whole number"),
    cli("top-zero", "estimate --model mlp --top 0", "--top", "positive whole number"),
    cli("seq-too-long", "estimate --model gpt2 --seq 4096", "exceeds", "--seq 1024"),
    cli(
        "precision-unknown",
        "estimate --model mlp --precision fp8",
        "unknown precision 'fp8'",
        "bf16-mixed",
    ),
    cli(
        "precision-typo", "estimate --model mlp --precision bf16mixed", "did you mean 'bf16-mixed'"
    ),
    cli("precision-case", "estimate --model mlp --precision BF16", "did you mean 'bf16'"),
    cli("checkpoint-case", "estimate --model mlp --checkpoint Full", "did you mean 'full'"),
    cli(
        "checkpoint-unknown",
        "estimate --model mlp --checkpoint selective",
        "unknown checkpoint mode",
        "none, full",
    ),
    cli(
        "command-typo",
        "estimat --model gpt2",
        "invalid choice: 'estimat'",
        "did you mean 'estimate'",
    ),
    cli("command-missing", "", "required: command", "gobrrr --help"),
    cli("flag-typo", "estimate --seqq 3", "unrecognized arguments: --seqq", "did you mean '--seq'"),
    cli("flag-typo-batch", "estimate --bach 3", "did you mean '--batch'"),
    cli("flag-plural", "estimate --gpus h100", "did you mean '--gpu'"),
    cli("flag-typo-json", "estimate --bach 3 --json", "did you mean '--batch'"),
    cli("bench-target-typo", "bench kernel", "invalid choice: 'kernel'", "did you mean 'kernels'"),
    cli("gpus-extra", "gpus h100", "unrecognized arguments: h100", "gobrrr --help"),
    cli("profile-no-workload", "profile", "name a workload", "gobrrr profile gpt2"),
    cli("profile-model-empty", "profile --model=", "--model is empty", "gpt2"),
    cli("profile-model-typo", "profile gpt-2", "unknown model 'gpt-2'", "did you mean 'gpt2'"),
    cli("profile-steps-zero", "profile mlp --steps 0", "--steps 0", "positive whole number"),
    cli("profile-gpu-typo", "profile mlp --gpu h10", "unknown GPU 'h10'", "did you mean 'h100'"),
    cli("profile-warmup-negative", "profile mlp --warmup -1", "--warmup -1", "0 or more"),
]

PATH_CASES = [
    cli(
        "save-graph-no-dir",
        "estimate --model mlp --save-graph nodir/g.json",
        "directory nodir does not exist",
        "mkdir -p nodir",
    ),
    cli(
        "save-graph-deep",
        "estimate --model mlp --save-graph a/b/c/g.json",
        "directory a/b/c does not exist",
        "mkdir -p a/b/c",
    ),
    cli(
        "save-graph-is-dir",
        "estimate --model mlp --save-graph out",
        "out is a directory",
        "file path",
        files={"out/": ""},
    ),
    cli(
        "save-graph-under-file",
        "estimate --model mlp --save-graph notes.txt/g.json",
        "notes.txt is a file",
        "inside a directory",
        files={"notes.txt": "x"},
    ),
    cli(
        "save-graph-no-dir-json",
        "estimate --model mlp --save-graph nodir/g.json --json",
        "does not exist",
    ),
    cli(
        "trace-no-dir",
        "profile mlp --device cpu --trace nodir/t.json",
        "--trace nodir/t.json",
        "mkdir -p nodir",
    ),
    cli(
        "trace-is-dir",
        "profile mlp --device cpu --trace out",
        "--trace out is a directory",
        "file path",
        files={"out/": ""},
    ),
    cli(
        "calibrate-output-deep",
        "calibrate --device cpu --output deep/er/c.json",
        "directory deep/er does not exist",
        "mkdir -p deep/er",
    ),
    cli(
        "calibrate-output-dir",
        "calibrate --device cpu --output out",
        "--output out is a directory",
        "file path",
        files={"out/": ""},
    ),
    cli(
        "bench-out-missing",
        "bench kernels --out nowhere",
        "--out nowhere does not exist",
        "mkdir -p nowhere",
    ),
    cli(
        "bench-out-file",
        "bench kernels --out notes.txt",
        "--out notes.txt is a file",
        "existing directory",
        files={"notes.txt": "x"},
    ),
    cli("bench-out-missing-json", "bench kernels --out nowhere --json", "does not exist"),
]

CASES = WORKLOAD_CASES + GPU_CASES + ARGUMENT_CASES + PATH_CASES


def _write(files: dict[str, str], root) -> None:
    for name, text in files.items():
        if name.endswith("/"):
            (root / name).mkdir(parents=True, exist_ok=True)
        else:
            (root / name).write_text(text)


def _forget_logged_once() -> None:
    """transformers logs some notices once per process: show them again in every case."""
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_first_contact(case: Case, tmp_path, monkeypatch, capfd):
    _write(case.files, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GOBRRR_DEBUG", raising=False)
    _forget_logged_once()
    code = main(list(case.argv))
    out, err = capfd.readouterr()
    assert code == case.code, err
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    for word in case.words:
        assert word.lower() in err.lower(), f"{word!r} not in {err!r}"
    if "--json" in case.argv:
        data = json.loads(out)
        if case.code:
            assert data["error"] and data["hint"], data
            assert data["error"] in err
    elif case.code:
        assert out == "", out


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 120
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
