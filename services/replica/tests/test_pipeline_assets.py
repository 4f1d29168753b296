"""Model assets: loaded from the fixture model's folder once per model, offline."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica.pipeline import ModelAssets, ModelAssetsCache
from inferplane.replica.pipeline.assets import sampling_defaults
from inferplane.replica.pipeline.requests import _sampling
from inferplane.replica.testing.pipeline import kimi_tiny_assets, kimi_tiny_spec
from inferplane.runtime import UnavailableError


def test_fixture_assets_resolve_eos_parser_markers_and_context() -> None:
    """The fixture's assets: eos = <|im_end|>'s id from the vocab, the kimi_k2 parser matching
    markers by the fixture's own ids, the spec's context length, a fast backend."""
    assets = kimi_tiny_assets()
    vocab = assets.tokenizer.get_vocab()
    assert vocab["<|im_end|>"] in assets.eos_token_ids
    assert assets.parser is not None
    assert assets.parser.marker_token_ids["</think>"] == vocab["</think>"]
    assert assets.max_model_len == 2048
    assert assets.vocab_size >= len(vocab)
    assert assets.backend.decode([vocab["<|tool_call_begin|>"]]) == "<|tool_call_begin|>"


def test_two_parser_names_are_a_configuration_error() -> None:
    """A spec naming different reasoning and tool parsers cannot be served (our parser does
    both): UNAVAILABLE with bad_replica_config, not a silent pick."""
    spec = nodeagent_pb2.ReplicaSpec()
    spec.CopyFrom(kimi_tiny_spec())
    spec.tool_parser = "other"
    with pytest.raises(UnavailableError) as info:
        asyncio.run(ModelAssetsCache().get(spec))
    assert info.value.code == "bad_replica_config"


def test_concurrent_first_requests_share_one_load_and_failures_are_retried() -> None:
    """Concurrent first requests for a model wait for one load (in a worker thread); a failed
    load is not cached, so the next request tries again; `on_loaded` runs once per successful
    load only."""
    calls: list[str] = []
    gate = threading.Event()
    fail = [True]

    def loader(spec: nodeagent_pb2.ReplicaSpec) -> ModelAssets:
        calls.append(spec.model_source)
        gate.wait(5)
        if fail[0]:
            raise UnavailableError("folder missing", code="model_unavailable")
        return kimi_tiny_assets()

    loaded: list[int] = []

    async def scenario() -> None:
        cache = ModelAssetsCache(loader, on_loaded=lambda: loaded.append(len(calls)))
        spec = kimi_tiny_spec()
        pending = [asyncio.create_task(cache.get(spec)) for _ in range(5)]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(r, UnavailableError) for r in results)
        assert len(calls) == 1
        fail[0] = False
        got = await asyncio.gather(cache.get(spec), cache.get(spec))
        assert got[0] is got[1] is kimi_tiny_assets()
        assert len(calls) == 2
        await cache.get(spec)
        assert len(calls) == 2
        assert loaded == [2]  # the hook (the heap freeze) ran once, after the successful load

    asyncio.run(scenario())


def test_the_fixture_spec_is_a_fresh_copy_per_call() -> None:
    """A test that changes the fixture spec (a stream interval, a parser name) changes only its
    own copy: later tests still get the original."""
    spec = kimi_tiny_spec()
    spec.stream_interval = 4
    spec.tool_parser = "other"
    again = kimi_tiny_spec()
    assert again is not spec
    assert (again.stream_interval, again.tool_parser) == (0, "kimi_k2")


def test_embed_assets_are_the_tokenizer_context_and_matryoshka_sizes(tmp_path) -> None:
    """An `embed` spec loads no parser (even when its spec names one: nothing is generated)
    and reads config.json's matryoshka_dimensions as vLLM does; `is_matryoshka` alone means
    every size up to the hidden size; no Matryoshka sizes for generate replicas."""
    import json
    import shutil

    from inferplane.replica.pipeline.assets import load_model_assets
    from inferplane.replica.testing.pipeline import embed_tiny_spec

    spec = embed_tiny_spec()
    spec.reasoning_parser = spec.tool_parser = "kimi_k2"
    assets = asyncio.run(ModelAssetsCache().get(spec))
    assert assets.parser is None and assets.matryoshka_dimensions == (16, 32, 64)
    assert assets.max_model_len == 512 and assets.vocab_size == 437
    assert assets.backend.truncation is None and assets.backend.padding is None
    assert kimi_tiny_assets().matryoshka_dimensions == ()

    folder = tmp_path / "embed"
    shutil.copytree(spec.model_source, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["matryoshka_dimensions"]
    (folder / "config.json").write_text(json.dumps(config))
    spec.model_source = str(folder)
    assert load_model_assets(spec).matryoshka_dimensions == ()
    config["is_matryoshka"] = True
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model_assets(spec).matryoshka_dimensions == tuple(range(1, 65))
    # A tokenizer.json that truncates: embeddings tokenize with the backend, which must not
    # cut inputs silently (vLLM refuses a too-long input instead).
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    long = "the quick brown fox jumps over the lazy dog"
    assert len(load_model_assets(spec).backend.encode(long).ids) > 4


def test_the_parser_name_picks_the_chat_family() -> None:
    """A replica renders chat requests for the family its spec's parser names (issue 19):
    qwen3-tiny with the qwen3 parser gets Qwen3 rendering — `reasoning_effort: "none"` turns
    `enable_thinking` off and history ids stay the client's — while kimi-tiny keeps Kimi's."""
    from inferplane.chat import KIMI_K2, QWEN3
    from inferplane.fixtures import qwen3_tiny
    from inferplane.replica.pipeline.assets import load_model_assets
    from inferplane.replica.pipeline.requests import plan_chat
    from inferplane.wire import chat_request_from_dict

    spec = nodeagent_pb2.ReplicaSpec(
        served_model_name=qwen3_tiny.SERVED_MODEL_NAME,
        model_source=str(qwen3_tiny.model_path()),
        max_model_len=qwen3_tiny.MAX_MODEL_LEN,
        reasoning_parser=qwen3_tiny.PARSER,
        tool_parser=qwen3_tiny.PARSER,
    )
    assets = load_model_assets(spec)
    assert assets.chat_family is QWEN3 and kimi_tiny_assets().chat_family is KIMI_K2
    vocab = assets.tokenizer.get_vocab()
    assert {vocab["<|im_end|>"], vocab["<|endoftext|>"]} <= assets.eos_token_ids
    assert assets.parser is not None
    assert assets.parser.marker_token_ids["<tool_call>"] == vocab["<tool_call>"]

    request = chat_request_from_dict({**qwen3_tiny.tools_request(), "reasoning_effort": "none"})
    plan = plan_chat(request, assets)
    assert plan.prompt.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert plan.prompt.thinking is False and plan.history_tool_calls == 1
    # History arguments render as the text the client sent back (what the model wrote: the
    # next turn's prompt then extends this one), not re-serialised through the template.
    (call,) = [c for m in qwen3_tiny.tools_request()["messages"] for c in m.get("tool_calls", [])]
    assert f'"arguments": {call["function"]["arguments"]}' in plan.prompt.text


def test_tool_constraints_are_written_in_the_models_own_format() -> None:
    """tool_choice required / named / auto (constrained) to a Qwen3-format replica send a
    grammar of Qwen3's `<tool_call>` JSON calls, not Kimi's section markers (issue 19): the
    grammar comes from the parser's `call_syntax`."""
    from inferplane.fixtures import qwen3_tiny
    from inferplane.replica.pipeline.assets import load_model_assets
    from inferplane.replica.pipeline.requests import plan_chat
    from inferplane.wire import chat_request_from_dict

    spec = nodeagent_pb2.ReplicaSpec(
        served_model_name=qwen3_tiny.SERVED_MODEL_NAME,
        model_source=str(qwen3_tiny.model_path()),
        max_model_len=qwen3_tiny.MAX_MODEL_LEN,
        reasoning_parser=qwen3_tiny.PARSER,
        tool_parser=qwen3_tiny.PARSER,
    )
    assets = load_model_assets(spec)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named, "auto"):
        request = chat_request_from_dict({**qwen3_tiny.tools_request(), "tool_choice": choice})
        plan = plan_chat(request, assets, constrain_tool_choice_auto=True)
        constraint = plan.params.constraint
        assert constraint is not None and constraint.kind == "structural_tag", choice
        assert '<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": ' in constraint.value
        assert "<|tool_call" not in constraint.value
        assert plan.calls_constrained


def test_generation_config_sampling_defaults_fill_what_a_request_omits() -> None:
    """generation_config.json's sampling parameters are the defaults of a request that omits
    them, as vLLM's `--generation-config auto` (`get_diff_sampling_param`): a value the request
    sets wins; values outside a request's range, and keys that are not sampling, are left out.
    The fixtures hold none, so their requests keep the engine's neutral defaults."""
    config = {
        "eos_token_id": 1,
        "do_sample": True,
        "max_new_tokens": 64,
        "temperature": 0.6,
        "top_k": 20,
        "repetition_penalty": 1.3,
        "top_p": 0.0,  # out of range (a request's top_p is above 0): left out
        "min_p": "0.1",  # not a number: left out
    }
    defaults = sampling_defaults(config)
    assert defaults == (("repetition_penalty", 1.3), ("temperature", 0.6), ("top_k", 20))
    assert kimi_tiny_assets().sampling_defaults == ()
    assets = dataclasses.replace(kimi_tiny_assets(), sampling_defaults=defaults)
    omitted = _sampling({}, assets, max_tokens=8, constraint=None)
    assert (omitted.temperature, omitted.top_k, omitted.repetition_penalty) == (0.6, 20, 1.3)
    assert omitted.top_p is None and omitted.min_p is None and omitted.max_tokens == 8
    given = _sampling(
        {"temperature": 0, "repetition_penalty": 1.0}, assets, max_tokens=8, constraint=None
    )
    assert (given.temperature, given.top_k, given.repetition_penalty) == (0.0, 20, 1.0)
    plain = _sampling({}, kimi_tiny_assets(), max_tokens=8, constraint=None)
    assert plain.temperature is None and plain.repetition_penalty is None


def test_spec_sampling_defaults_win_over_generation_config_and_lose_to_the_request() -> None:
    """A spec's `sampling_defaults` (its deployment profile's, vLLM's
    `--override-generation-config`) override the model's generation_config defaults field by
    field (spec > generation_config > the engine's neutral value); a request's own value wins
    over both. A spec that sets none gets the model's assets themselves; one replica process
    serving two specs of one model gives each its own defaults from one load."""
    model = dataclasses.replace(
        kimi_tiny_assets(), sampling_defaults=(("repetition_penalty", 1.1), ("temperature", 0.6))
    )

    async def main() -> None:
        cache = ModelAssetsCache(lambda spec: model)
        plain = kimi_tiny_spec()
        assert await cache.get(plain) is model
        spec = kimi_tiny_spec()
        spec.sampling_defaults.repetition_penalty = 1.3
        spec.sampling_defaults.top_k = 5
        spec.sampling_defaults.top_p = 0.0  # out of a request's range: left out
        assets = await cache.get(spec)
        assert assets.sampling_defaults == (
            ("repetition_penalty", 1.3),
            ("temperature", 0.6),
            ("top_k", 5),
        )
        assert await cache.get(spec) is assets  # derived once
        assert await cache.get(plain) is model
        omitted = _sampling({}, assets, max_tokens=8, constraint=None)
        assert (omitted.repetition_penalty, omitted.temperature, omitted.top_k) == (1.3, 0.6, 5)
        assert omitted.top_p is None
        given = _sampling(
            {"repetition_penalty": 1.0, "top_k": -1}, assets, max_tokens=8, constraint=None
        )
        assert (given.repetition_penalty, given.temperature, given.top_k) == (1.0, 0.6, 0)
        empty = kimi_tiny_spec()
        empty.sampling_defaults.SetInParent()  # present, nothing set: nothing changes
        assert await cache.get(empty) is model

    asyncio.run(main())
