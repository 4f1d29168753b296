"""The engine-argument allow-list (issue 18): what passes, what is refused and how the error
names it, and that every listed flag is one vLLM 0.32's engine-argument parser takes."""

from __future__ import annotations

import pytest

from inferplane.engine_args import (
    ALLOWED_FLAGS,
    PROFILE_OWNED,
    EngineArg,
    EngineArgError,
    Integer,
    Switch,
    check_engine_args,
)


def refused(*args: str) -> EngineArgError:
    with pytest.raises(EngineArgError) as info:
        check_engine_args(args)
    return info.value


def test_allowed_flags_pass_in_both_spellings() -> None:
    args = (
        "--enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "8192",
        "--block-size=32",
        "--kv-cache-dtype",
        "fp8",
        "--seed=0",
        "--performance-mode",
        "throughput",
    )
    assert check_engine_args(args) == (
        EngineArg("--enable-prefix-caching"),
        EngineArg("--enable-chunked-prefill", negated=True),
        EngineArg("--max-num-batched-tokens", value="8192"),
        EngineArg("--block-size", value="32"),
        EngineArg("--kv-cache-dtype", value="fp8"),
        EngineArg("--seed", value="0"),
        EngineArg("--performance-mode", value="throughput"),
    )
    assert check_engine_args(()) == ()


@pytest.mark.parametrize(
    "args",
    [
        ("--trust-remote-code",),
        ("--trust-remote-code=true",),
        ("--trust_remote_code",),  # vLLM's parser takes underscores
        ("--trust-remote",),  # and prefixes of long names
        ("--worker-cls", "evil.Worker"),
        ("--logits-processors", "evil.Processor"),
        ("--tokenizer", "victim-tokenizer"),
        ("--download-dir", "/tmp/x"),
        ("--kv-transfer-config", '{"kv_connector": "x"}'),
        ("--otlp-traces-endpoint", "http://attacker:4317"),
        ("--enable-log-requests",),
        ("--config", "args.yaml"),
        ("-tp", "8"),
        ("--host", "0.0.0.0"),
    ],
)
def test_anything_off_the_list_is_refused_naming_the_flag(args: tuple[str, ...]) -> None:
    """Invariant: a flag that can run code, open connections, read paths or log prompts never
    passes, in any spelling vLLM would understand."""
    error = refused("--seed", "1", *args)
    flag = args[0].partition("=")[0]
    assert error.flag == flag
    assert f"engine argument {flag!r} is not allowed; allowed: " in str(error)
    assert "--enable-prefix-caching" in str(error)


def test_a_flag_a_profile_field_owns_points_at_the_field() -> None:
    error = refused("--gpu-memory-utilization", "0.99")
    assert str(error) == (
        "engine argument --gpu-memory-utilization is set from placement, from the profile's "
        "sizing; set that instead"
    )
    assert refused("--max-model-len=4096").flag == "--max-model-len"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--seed", "--trust-remote-code"), "--seed takes an integer 0-4294967295; got "),
        (("--seed", "1_000"), "--seed takes an integer"),
        (("--seed", "٣"), "--seed takes an integer"),  # int() would take Arabic-Indic digits
        (("--block-size", "0"), "--block-size takes an integer 1-1024; got '0'"),
        (("--block-size=",), "--block-size takes an integer 1-1024; got ''"),
        (("--kv-cache-dtype", "fp8_ds_mla"), "--kv-cache-dtype takes one of auto, bfloat16"),
        (("--prefix-caching-hash-algo", "xxhash"), "takes one of sha256, sha256_cbor; got"),
        (("--max-num-batched-tokens",), "--max-num-batched-tokens needs a value"),
        (("--enforce-eager=false",), "--enforce-eager takes no value; got 'false'"),
        (("--no-seed", "1"), "engine argument '--no-seed' is not allowed"),
        (("--seed", "1", "--seed", "2"), "--seed is given twice"),
        (("--enforce-eager", "--no-enforce-eager"), "--no-enforce-eager is given twice"),
        (("trust-remote-code",), "'trust-remote-code' is not a flag"),
        (("--",), "'--' is not a flag"),
    ],
)
def test_values_are_checked(args: tuple[str, ...], message: str) -> None:
    assert message in str(refused(*args))


def test_a_long_refused_item_is_cut_in_the_message() -> None:
    error = refused("--x" * 1000)
    assert len(str(error)) < 1000 and error.flag.endswith("...")


def test_every_listed_flag_is_one_vllm_takes() -> None:
    """The list stays true to the engine: each allowed flag (and each switch's `--no-` form)
    with a value its rule accepts parses with vLLM 0.32's engine-argument parser, the one the
    `inproc` transport uses, and each flag a profile field owns exists there too."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="check"))
    known = {option for action in parser._actions for option in action.option_strings}
    assert set(PROFILE_OWNED) <= known
    for flag in ALLOWED_FLAGS.values():
        rule = flag.rule
        if isinstance(rule, Switch):
            forms = [[flag.name], ["--no-" + flag.name.removeprefix("--")]]
        elif isinstance(rule, Integer):
            forms = [[flag.name, str(max(rule.low, 1))]]
        else:
            forms = [[flag.name, value] for value in rule.values]
        for form in forms:
            check_engine_args(form)
            parser.parse_args(["--model", "m", *form])


@pytest.mark.parametrize("flag", ["--enable-lora", "--max-loras", "--max-lora-rank"])
def test_lora_flags_point_at_the_profile_fields(flag: str) -> None:
    """LoRA is configured by `max_loras` / `max_lora_rank` (issue 29), never by raw flags."""
    error = refused(flag) if flag == "--enable-lora" else refused(flag, "8")
    assert error.flag == flag and "profile.max_lora" in str(error)
    assert str(refused("--enable-lora")).startswith(
        "engine argument --enable-lora is set from profile.max_loras"
    )
