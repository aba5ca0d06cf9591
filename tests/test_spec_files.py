"""A user's GPU spec file: read against its schema, every bad value an error naming the file,
the key and the form expected; "did you mean" for near misses."""

import json

import pytest

from gobrrr.errors import GobrrrError, did_you_mean
from gobrrr.hardware import SPEC_KEYS, get_gpu, load_gpu_file, read_spec_file

GOOD = {"name": "mygpu", "memory_gb": 16, "bandwidth_gbs": 500, "bf16_tflops": 100}


def write(tmp_path, data, suffix=".json"):
    p = tmp_path / f"g{suffix}"
    p.write_text(json.dumps(data) if suffix == ".json" else data)
    return p


def test_a_good_file_gives_the_spec_in_si_units(tmp_path):
    spec = load_gpu_file(write(tmp_path, {**GOOD, "sms": 66, "fp8_tflops": 400}))
    assert spec.name == "mygpu" and spec.full_name == "mygpu"
    assert spec.memory_bytes == 16 * 10**9 and spec.bandwidth == 500e9
    # defaults: fp16 = bf16, tf32 = bf16 / 2, fp32 = bf16 / 15 (CUDA cores)
    assert spec.peak_flops == pytest.approx(
        {"bf16": 100e12, "fp16": 100e12, "tf32": 50e12, "fp32": 100e12 / 15, "fp8": 400e12}
    )
    assert spec.sms == 66 and isinstance(spec.sms, int)
    assert spec.launch_overhead == pytest.approx(10e-6)


def test_toml_and_json_read_the_same(tmp_path):
    toml = 'name = "mygpu"\nmemory_gb = 16\nbandwidth_gbs = 500\nbf16_tflops = 100\n'
    assert load_gpu_file(write(tmp_path, toml, ".toml")) == load_gpu_file(write(tmp_path, GOOD))


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("bf16_tflops", True, ("bf16_tflops is True", "a bool, not a number")),
        ("memory_gb", "16GB", ("memory_gb is '16GB'", "without quotes or units")),
        ("memory_gb", float("nan"), ("memory_gb is nan", "finite")),
        ("bandwidth_gbs", float("inf"), ("bandwidth_gbs is inf", "finite")),
        ("bandwidth_gbs", -3, ("bandwidth_gbs is -3", "> 0")),
        ("bf16_tflops", 0, ("bf16_tflops is 0", "> 0")),
        ("sms", 2.5, ("sms is 2.5", "whole number")),
        ("sms", True, ("sms is True", "whole number")),
        ("name", "", ("name is ''", "quoted string")),
        ("name", 7, ("name is 7", "quoted string")),
        ("fp32_tflops", [1], ("fp32_tflops is [1]", "number")),
    ],
)
def test_each_bad_value_names_the_file_the_key_and_the_form(tmp_path, key, value, words):
    p = write(tmp_path, {**GOOD, key: value})
    with pytest.raises(GobrrrError) as e:
        read_spec_file(p)
    assert str(p) in str(e.value) and e.value.hint
    for w in words:
        assert w in str(e.value)


def test_integral_numbers_are_accepted_for_counts(tmp_path):
    assert read_spec_file(write(tmp_path, {**GOOD, "sms": 132.0}))["sms"] == 132


def test_unknown_keys_say_which_real_key_was_meant(tmp_path):
    with pytest.raises(GobrrrError, match="unknown key 'memory_gib'.*did you mean 'memory_gb'"):
        read_spec_file(write(tmp_path, {**GOOD, "memory_gib": 3}))
    with pytest.raises(GobrrrError) as e:
        read_spec_file(write(tmp_path, {**GOOD, "vendor": "x"}))
    assert "did you mean" not in str(e.value)
    assert all(k.key in e.value.hint for k in SPEC_KEYS)


def test_missing_keys_are_listed_with_what_they_mean(tmp_path):
    with pytest.raises(GobrrrError) as e:
        read_spec_file(write(tmp_path, {"name": "x"}))
    assert "lacks memory_gb, bandwidth_gbs, bf16_tflops" in e.value.message
    assert "GB/s" in e.value.hint and "TFLOP/s" in e.value.hint


def test_a_directory_is_not_a_spec_file(tmp_path):
    (tmp_path / "x.toml").mkdir()
    with pytest.raises(GobrrrError, match="is a directory"):
        get_gpu(str(tmp_path / "x.toml"))
    with pytest.raises(GobrrrError, match="is a directory"):
        get_gpu(str(tmp_path))


def test_gpu_names_did_you_mean():
    with pytest.raises(GobrrrError, match="did you mean 'h100'"):
        get_gpu("h10")
    assert get_gpu("H100").name == "h100-sxm"  # names are case-insensitive


@pytest.mark.parametrize(
    "word,choices,expected",
    [
        ("gpt-2", ["gpt2", "mlp"], " (did you mean 'gpt2'?)"),
        ("GPT2", ["gpt2", "mlp"], " (did you mean 'gpt2'?)"),
        ("convnett", ["gpt2", "convnet"], " (did you mean 'convnet'?)"),
        ("resnet50", ["gpt2", "convnet"], ""),
        ("gpt2", ["gpt2"], ""),  # not a misspelling
        ("rtx_4090", ["rtx4090", "rtx-4090"], " (did you mean 'rtx4090'?)"),  # the first spelling
    ],
)
def test_did_you_mean(word, choices, expected):
    assert did_you_mean(word, choices) == expected


def test_an_error_keeps_its_hint_apart_and_prints_both():
    e = GobrrrError("unknown GPU 'x'", hint="choose one of a, b")
    assert e.message == "unknown GPU 'x'" and e.hint == "choose one of a, b"
    assert str(e) == "unknown GPU 'x': choose one of a, b"
    assert str(GobrrrError("plain")) == "plain" and GobrrrError("plain").hint is None
