"""Admission by predicted KV fit through the whole stack, on a replica whose KV cache fills
(issue 29, item 5).

Its own stack (module scope): one kimi-tiny replica (`inproc`, vLLM's CPU engine) with 8
sequences of 2,048 tokens and a KV budget sized for 128 expected tokens per sequence, which
the orchestrator's sizing raises to its floor, one 2,048-token sequence plus a block: 17
blocks of 128 tokens (2,228,224 bytes), passed to vLLM as `--kv-cache-memory-bytes`. The
router's queue waits up to 120 s, and its prompt estimate counts 1.8 bytes per token (the
fixture's small vocabulary makes 1.9 on these prompts: a slight overestimate;
`kv_fit_bytes_per_token`).

The load: `CONCURRENT` chat requests at once through the edge, each a distinct ~700-token
prompt (6 blocks) generating exactly `MAX_TOKENS` (`ignore_eos`), so each grows to 9 of the
16 usable blocks: two of them fit the slot cap but not the KV cache.

- KV-fit admission on (the default): the engine's bytes are exactly the placement's (17
  blocks), every request succeeds, and `vllm:num_preemptions_total` does not move;
- the router restarted with `--no-kv-fit` (the slot cap alone): the same load preempts
  (`vllm:num_preemptions_total` rises), every request still succeeding (vLLM recomputes).

67-152 s on this machine (one engine start, two rounds of load, a router restart): measured
+0 and +3 preemptions in both runs.
"""

from __future__ import annotations

import random
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import openai
import pytest

from inferplane.localstack import MODEL_NAME, Stack, running_stack

from .conftest import local_config

pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(1500)]

MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 8
EXPECTED_CONTEXT = 128  # below one max_model_len sequence: the sizing floor applies
BLOCK = 128  # vLLM's CPU block size
KV_BYTES_PER_TOKEN = 1024  # kimi-tiny's fp32 KV: 2 layers × 2 heads × 32 × K, V × 4 B
FLOOR_BLOCKS = MAX_MODEL_LEN // BLOCK + 1
PROMPT_WORDS = 220  # ~700 tokens of kimi-tiny's tokenizer (1.9 bytes per token on these)
MAX_TOKENS = 384
CONCURRENT = 6
WORDS = ("alpha", "beta", "gamma", "delta", "weather", "city", "paris", "tokyo", "report")


@pytest.fixture(scope="module")
def kv_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir: Path = tmp_path_factory.mktemp("kv-fit")
    config = local_config(
        data_dir,
        transport="inproc",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        expected_context_tokens=EXPECTED_CONTEXT,
        service_args={
            "router": (
                "--queue-timeout-seconds",
                "120",
                "--kv-fit-bytes-per-token",
                "1.8",
            )
        },
    )
    with running_stack(config, print) as stack:
        yield stack


def _metrics(url: str) -> dict[str, list[tuple[str, float]]]:
    """Samples by metric name: (the sample with its labels, value)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        out.setdefault(sample.split("{", 1)[0], []).append((sample, float(value)))
    return out


def _total(url: str, name: str) -> float:
    return sum(value for _, value in _metrics(url).get(name, []))


def _prompt(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


def _round(client: openai.OpenAI, seed: int) -> list[int]:
    """`CONCURRENT` requests at once; each one's completion tokens."""

    def one(i: int) -> int:
        reply = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": _prompt(seed * 100 + i)}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens

    with futures.ThreadPoolExecutor(CONCURRENT) as pool:
        return list(pool.map(one, range(CONCURRENT)))


def _wait_served(client: openai.OpenAI, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            return
        except openai.APIError:
            assert time.monotonic() < deadline, "the stack did not serve again"
            time.sleep(1)


def test_kv_fit_admission_keeps_preemptions_at_zero_where_the_slot_cap_alone_does_not(
    kv_stack: Stack,
) -> None:
    key = kv_stack.create_api_key("kv-fit")
    client = openai.OpenAI(
        base_url=kv_stack.config.base_url, api_key=key, max_retries=0, timeout=300
    )
    (endpoint,) = kv_stack.serving_endpoints()
    replica = kv_stack.replica(endpoint.replica_id)
    engine = replica.metrics_url
    router = f"http://127.0.0.1:{kv_stack.config.metrics_ports['router']}/metrics"

    # The placement's bytes reached vLLM exactly: the floor of one 2,048-token sequence + a
    # block, and the engine made that many blocks of it.
    assert replica.spec.kv_cache_bytes == FLOOR_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN
    (info,) = _metrics(engine)["vllm:cache_config_info"]
    assert f'num_gpu_blocks="{FLOOR_BLOCKS}"' in info[0]

    _wait_served(client, 60)
    time.sleep(2)  # the router's replica state watch has the engine's capacity by now
    assert _total(router, "inferplane_router_replica_state_streams") == 1

    before = _total(engine, "vllm:num_preemptions_total")
    assert _round(client, 1) == [MAX_TOKENS] * CONCURRENT
    with_kv_fit = _total(engine, "vllm:num_preemptions_total") - before
    refused = [
        v
        for sample, v in _metrics(router).get("inferplane_router_queue_refusals_total", [])
        if 'reason="kv_cache_full"' in sample
    ]
    print(f"kv_fit_preemptions: {with_kv_fit:g}")
    assert with_kv_fit == 0
    assert sum(refused) == 0

    # The slot cap alone: the router restarted without KV-fit admission.
    process = kv_stack.processes["router"]
    process.stop()
    process.argv.append("--no-kv-fit")
    process.start()
    _wait_served(client, 120)

    before = _total(engine, "vllm:num_preemptions_total")
    assert _round(client, 2) == [MAX_TOKENS] * CONCURRENT
    slots_only = _total(engine, "vllm:num_preemptions_total") - before
    print(f"slot_cap_preemptions: {slots_only:g}")
    assert slots_only > 0
