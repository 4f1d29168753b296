"""OpenAI text completion request → what the engine runs (`plan_completion`).

The same rules as chat (`pipeline/requests.py`: ranges, `n`, stop strings and ids, the field
policy of `pipeline/fields.py`), plus: `prompt` is one string or one list of token ids (a
batch of several prompts is refused); `echo` prepends the prompt text; `logprobs` 0 to 20
alternatives per token; `max_tokens` defaults to 16 (OpenAI's default); `add_special_tokens`
(default true) lets the tokenizer add BOS to a text prompt; `skip_special_tokens` leaves
special tokens out of the text; `response_format` json, `structured_outputs` and `guided_*`
constrain the whole output (`pipeline/structured.py`); `suffix` is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.promptsize import check_prompt_size
from inferplane.replica.engines.base import EngineConstraint, SamplingParams
from inferplane.replica.pipeline import structured
from inferplane.replica.pipeline.assets import ModelAssets
from inferplane.replica.pipeline.fields import COMPLETION_FIELDS
from inferplane.replica.pipeline.requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    Reporting,
    _bad,
    _common_checks,
    _logprobs_count,
    _max_tokens,
    _positive_int,
    _reporting,
    _response_format,
    _sampling,
)
from inferplane.replica.pipeline.schemas import check_compiles
from inferplane.wire import completion_request_to_dict


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionPlan:
    """A validated text completion request.

    Attributes:
        prompt_ids: the prompt's token ids.
        echo_text: the prompt text to prepend to the output (`echo`), else "".
        params: the engine's sampling parameters.
        include_usage: `stream_options.include_usage`.
        report: how the response reports (choices, logprobs, usage on chunks).
    """

    prompt_ids: list[int]
    echo_text: str
    params: SamplingParams
    include_usage: bool
    report: Reporting = dataclasses.field(default_factory=Reporting)


def _prompt_ids(
    prompt: Any, assets: ModelAssets, add_special_tokens: bool = True
) -> tuple[list[int], str]:
    """`(token ids, prompt text)` of a completion prompt: a string, a list of token ids, or a
    one-element list of either (OpenAI's batch forms with several prompts are refused)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        ids = [
            int(i) for i in assets.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ]
        return ids, prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    ):
        bad = next((i for i in prompt if not 0 <= i < assets.vocab_size), None)
        if bad is not None:
            raise _bad(f"prompt token id {bad} is outside the vocabulary", "prompt")
        return list(prompt), ""
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad(
            "'prompt' must be one prompt: inferplane serves one choice per request", "prompt"
        )
    raise _bad("'prompt' must be a string or an array of token ids", "prompt")


def plan_completion(request: pb.CompletionRequest, assets: ModelAssets) -> CompletionPlan:
    """Validates a text completion request for `assets`' model.

    Raises:
        InvalidArgumentError: the request is invalid or asks for something unsupported; a
            prompt whose size alone exceeds the context (`context_length_exceeded`, before
            it is tokenized: `inferplane.promptsize`).
    """
    check_prompt_size(request, assets.max_model_len, assets.token_bound)
    body = completion_request_to_dict(request)
    n = _common_checks(body, COMPLETION_FIELDS)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _logprobs_count(logprobs, "logprobs")
    if "prompt" not in body:
        raise _bad("'prompt' is required", "prompt")
    ids, text = _prompt_ids(
        body["prompt"], assets, add_special_tokens=body.get("add_special_tokens") is not False
    )
    echo = bool(body.get("echo"))
    if echo and not text:
        text = assets.tokenizer.decode(ids, skip_special_tokens=False)
    max_tokens = _max_tokens(
        _positive_int(body, "max_tokens"), len(ids), assets, DEFAULT_COMPLETION_MAX_TOKENS, "prompt"
    )
    constraint = _completion_constraint(body)
    params = _sampling(
        body,
        assets,
        max_tokens=max_tokens,
        constraint=constraint,
        logprobs=logprobs,
        skip_special_tokens=bool(body.get("skip_special_tokens")),
    )
    options = body.get("stream_options") or {}
    return CompletionPlan(
        prompt_ids=ids,
        echo_text=text if echo else "",
        params=params,
        include_usage=bool(options.get("include_usage")),
        report=_reporting(body, n, logprobs is not None),
    )


def _completion_constraint(body: Mapping[str, Any]) -> EngineConstraint | None:
    """A text completion's constraint: `response_format` json (vLLM serves it on completions
    too) or `structured_outputs` / `guided_*`; the whole output is constrained (no template,
    no reasoning)."""
    wants_json, schema = _response_format(body)
    wanted = structured.requested(body)
    if wants_json:
        if wanted is not None:
            raise _bad(f"'{wanted[0]}' cannot be combined with response_format json", wanted[0])
        wanted = (
            "response_format",
            "json" if schema is not None else "json_object",
            schema if schema is not None else True,
        )
    if wanted is None:
        return None
    if wanted[1] == "json" and isinstance(wanted[2], Mapping):
        check_compiles([(wanted[0], wanted[2])])
    return structured.build(wanted, thinking=False, syntax=None)
