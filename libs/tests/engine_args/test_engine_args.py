"""The engine-argument allow-list (issue 18): what passes, what is refused and how the error
names it, and that every listed flag is one vLLM 0.32's engine-argument parser takes."""

from __future__ import annotations

import pytest

from inferplane.engine_args import (
    ALLOWED_FLAGS,
    ALLOWED_FLAGS_BY_VERSION,
    DEFAULT_ENGINE_VERSION,
    PROFILE_OWNED,
    VERSION_DIFFERENCES,
    EngineArg,
    EngineArgError,
    Integer,
    Switch,
    allowed_flags,
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
    """The list stays true to the engine: each flag of the installed vLLM's list (and each
    switch's `--no-` form) with a value its rule accepts parses with that vLLM's
    engine-argument parser, the one the `inproc` transport uses, and each flag a profile field
    owns exists there too. Run it with each engine's interpreter (engines/README.md)."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from inferplane.artifacts import engine_package_version

    installed = engine_package_version()
    assert installed is not None
    _, version = installed
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="check"))
    known = {option for action in parser._actions for option in action.option_strings}
    assert set(PROFILE_OWNED) <= known
    for flag in allowed_flags(version).values():
        rule = flag.rule
        if isinstance(rule, Switch):
            forms = [[flag.name], ["--no-" + flag.name.removeprefix("--")]]
        elif isinstance(rule, Integer):
            forms = [[flag.name, str(max(rule.low, 1))]]
        else:
            forms = [[flag.name, value] for value in rule.values]
        for form in forms:
            check_engine_args(form, version)
            parser.parse_args(["--model", "m", *form])


def test_each_engine_version_has_its_list_derived_by_stated_differences() -> None:
    """0.32.0's list is the default (ALLOWED_FLAGS, an empty version); 0.31.0's is 0.32.0's
    plus `--disable-cascade-attn` (cascade attention exists in 0.31 only; a no-op in 0.32)."""
    assert set(ALLOWED_FLAGS_BY_VERSION) == {"0.31.0", "0.32.0"}
    assert allowed_flags("") is ALLOWED_FLAGS is allowed_flags(DEFAULT_ENGINE_VERSION)
    v31, v32 = ALLOWED_FLAGS_BY_VERSION["0.31.0"], ALLOWED_FLAGS_BY_VERSION["0.32.0"]
    assert set(v31) - set(v32) == {"--disable-cascade-attn"} and set(v32) <= set(v31)
    assert VERSION_DIFFERENCES["0.31.0"].base == "0.32.0"
    assert allowed_flags("0.32.4") is v32 and allowed_flags("0.31.1") is v31
    assert check_engine_args(["--no-disable-cascade-attn"], "0.31.0") == (
        EngineArg("--disable-cascade-attn", negated=True),
    )
    with pytest.raises(EngineArgError, match="'--disable-cascade-attn' is not allowed"):
        check_engine_args(["--disable-cascade-attn"], "0.32.0")
    with pytest.raises(EngineArgError, match="'--disable-cascade-attn' is not allowed"):
        check_engine_args(["--disable-cascade-attn"])


def test_an_engine_version_without_a_list_refuses_arguments_only() -> None:
    assert check_engine_args((), "0.9.0") == ()
    with pytest.raises(EngineArgError, match=r"engine_version .0\.9\.0. has no engine-argument"):
        check_engine_args(["--seed", "1"], "0.9.0")
    with pytest.raises(KeyError, match=r"known: 0\.31\.0, 0\.32\.0"):
        allowed_flags("1.0.0")


@pytest.mark.parametrize("flag", ["--enable-lora", "--max-loras", "--max-lora-rank"])
def test_lora_flags_point_at_the_profile_fields(flag: str) -> None:
    """LoRA is configured by `max_loras` / `max_lora_rank` (issue 29), never by raw flags."""
    error = refused(flag) if flag == "--enable-lora" else refused(flag, "8")
    assert error.flag == flag and "profile.max_lora" in str(error)
    assert str(refused("--enable-lora")).startswith(
        "engine argument --enable-lora is set from profile.max_loras"
    )
