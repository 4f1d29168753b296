"""A pinned benchmark workload: what one side of a performance comparison sends, defined once in
a JSON file (`bench/workloads/<name>.json`), validated, digested, and mapped onto GuideLLM's
scenario so that two runs of one spec send the same conversations in the same arrival pattern.

The spec (every field required unless said otherwise; JSON Schema in `WORKLOAD_SCHEMA`):

- `name` (the file's stem), `description`, `seed` (GuideLLM's `--seed`: the synthetic text, the
  token counts drawn, the Poisson arrivals), `request_format` (`/v1/chat/completions`),
  `tokenizer` (the folder whose tokenizer sizes the synthetic text, relative to the repository;
  the same for every model, so both sides get identical prompts);
- `conversations`: `system_prompts` distinct shared system prompts of `system_prompt_tokens`
  tokens each (the prefix a prefix cache reuses), `turns` per conversation (each turn carries the
  conversation's history: GuideLLM's multi-turn synthetic data), `prompt_tokens` and
  `output_tokens` per turn ({mean, stdev, min, max}; outputs are forced to that length with
  `ignore_eos`), optional `think_time_seconds` between turns ({mean, stdev, min, max});
- `arrivals`: `kind` "poisson" (bursty) or "constant", `rate` (new requests per second),
  `max_concurrency` (requests in flight at most);
- `bounds`: `max_requests` and `max_seconds`: the side ends at whichever comes first;
- `client` (optional): `worker_processes` of GuideLLM (default 2; pinned because the client's
  parallelism shapes the arrivals it can keep).

Errors: `WorkloadError` names the file and the field path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema

REPO_ROOT = Path(__file__).resolve().parents[3]
"""The repository root (found relative to this file: libs/inferplane/benchmark/)."""
WORKLOADS_DIR = REPO_ROOT / "bench" / "workloads"
"""Where named workloads live: `<name>.json`."""
DEFAULT_WORKLOAD = "agentic-v1"
"""The workload the performance gate runs when the profile names none
(`ReleaseGates.benchmark_workload` "")."""

_RANGE: dict[str, Any] = {
    "type": "object",
    "required": ["mean"],
    "additionalProperties": False,
    "properties": {
        "mean": {"type": "number", "minimum": 0},
        "stdev": {"type": "number", "minimum": 0},
        "min": {"type": "number", "minimum": 0},
        "max": {"type": "number", "minimum": 0},
    },
}
_TOKENS: dict[str, Any] = {
    **_RANGE,
    "properties": {**_RANGE["properties"], "mean": {"type": "integer", "minimum": 1}},
}

WORKLOAD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "name",
        "description",
        "seed",
        "request_format",
        "tokenizer",
        "conversations",
        "arrivals",
        "bounds",
    ],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9.-]*$"},
        "description": {"type": "string"},
        "seed": {"type": "integer", "minimum": 0},
        "request_format": {"enum": ["/v1/chat/completions"]},
        "tokenizer": {"type": "string", "minLength": 1},
        "conversations": {
            "type": "object",
            "additionalProperties": False,
            "required": [
                "system_prompts",
                "system_prompt_tokens",
                "turns",
                "prompt_tokens",
                "output_tokens",
            ],
            "properties": {
                "system_prompts": {"type": "integer", "minimum": 1},
                "system_prompt_tokens": {"type": "integer", "minimum": 0},
                "turns": {"type": "integer", "minimum": 1, "maximum": 32},
                "prompt_tokens": _TOKENS,
                "output_tokens": _TOKENS,
                "think_time_seconds": _RANGE,
            },
        },
        "arrivals": {
            "type": "object",
            "additionalProperties": False,
            "required": ["kind", "rate", "max_concurrency"],
            "properties": {
                "kind": {"enum": ["poisson", "constant"]},
                "rate": {"type": "number", "exclusiveMinimum": 0},
                "max_concurrency": {"type": "integer", "minimum": 1},
            },
        },
        "bounds": {
            "type": "object",
            "additionalProperties": False,
            "required": ["max_requests", "max_seconds"],
            "properties": {
                "max_requests": {"type": "integer", "minimum": 1},
                "max_seconds": {"type": "number", "exclusiveMinimum": 0},
            },
        },
        "client": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"worker_processes": {"type": "integer", "minimum": 1, "maximum": 16}},
        },
    },
}


class WorkloadError(ValueError):
    """A workload file is missing, not JSON, or not a valid spec (the message names the file
    and the field path)."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """One validated workload spec.

    Attributes:
        spec: the document as loaded (a plain JSON object; never mutated).
        digest: `sha256:` + hex SHA-256 of the canonical JSON of `spec` (sorted keys, no
            spaces): two reports with one digest ran one workload.
        source: the file it came from ("" when built from a mapping).
    """

    spec: Mapping[str, Any]
    digest: str
    source: str = ""

    @property
    def name(self) -> str:
        """The workload's name (`agentic-v1`)."""
        return str(self.spec["name"])

    @property
    def seed(self) -> int:
        """The seed of the synthetic data and the arrivals."""
        return int(self.spec["seed"])

    @property
    def max_seconds(self) -> float:
        """The bound on one side's request phase, seconds."""
        return float(self.spec["bounds"]["max_seconds"])

    @property
    def worker_processes(self) -> int:
        """GuideLLM's worker processes (`client.worker_processes`, default 2)."""
        return int(self.spec.get("client", {}).get("worker_processes", 2))

    def tokenizer_path(self) -> Path:
        """The tokenizer folder (`tokenizer`, relative to the repository root unless absolute)."""
        path = Path(self.spec["tokenizer"])
        return path if path.is_absolute() else REPO_ROOT / path

    def guidellm_data(self) -> dict[str, Any]:
        """GuideLLM's `synthetic_text` data arguments for this spec (multi-turn with history,
        `prefix_count` shared prefixes of `prefix_tokens`: sent as the system message)."""
        conv = self.spec["conversations"]
        data: dict[str, Any] = {
            "kind": "synthetic_text",
            "turns": conv["turns"],
            "prefix_count": conv["system_prompts"],
            "prefix_tokens": conv["system_prompt_tokens"],
        }
        for field, prefix, cast in (
            ("prompt_tokens", "prompt_tokens", int),
            ("output_tokens", "output_tokens", int),
            ("think_time_seconds", "delay", float),
        ):
            figures = conv.get(field)
            if figures is None:
                continue
            data[prefix] = cast(figures["mean"])
            for key in ("stdev", "min", "max"):
                if key in figures:
                    data[f"{prefix}_{key}"] = cast(figures[key])
        return data

    def guidellm_profile(self) -> dict[str, Any]:
        """GuideLLM's profile: `poisson` / `constant` at `rate`, `max_concurrency` in flight."""
        arrivals = self.spec["arrivals"]
        return {
            "kind": arrivals["kind"],
            "rate": [float(arrivals["rate"])],
            "max_concurrency": int(arrivals["max_concurrency"]),
        }

    def guidellm_constraints(self) -> list[dict[str, Any]]:
        """GuideLLM's constraints: `max_requests` and `max_duration` from `bounds`."""
        bounds = self.spec["bounds"]
        return [
            {"kind": "max_requests", "count": int(bounds["max_requests"])},
            {"kind": "max_duration", "seconds": float(bounds["max_seconds"])},
        ]


def workload_digest(spec: Mapping[str, Any]) -> str:
    """`sha256:<hex>` of the canonical JSON of `spec` (sorted keys, compact separators)."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def validate_workload(spec: Any, source: str = "<workload>") -> Workload:
    """Validates `spec` against `WORKLOAD_SCHEMA` and the ranges' order (min ≤ mean ≤ max).

    Raises:
        WorkloadError: the first violation, as `<source>: <field.path>: <message>`.
    """
    try:
        jsonschema.validate(spec, WORKLOAD_SCHEMA)
    except jsonschema.ValidationError as error:
        path = ".".join(str(p) for p in error.absolute_path) or "(root)"
        raise WorkloadError(f"{source}: {path}: {error.message}") from None
    for field in ("prompt_tokens", "output_tokens", "think_time_seconds"):
        figures = spec["conversations"].get(field)
        if figures is None:
            continue
        low = figures.get("min", figures["mean"])
        high = figures.get("max", figures["mean"])
        if not low <= figures["mean"] <= high:
            raise WorkloadError(
                f"{source}: conversations.{field}: min <= mean <= max does not hold "
                f"({low}, {figures['mean']}, {high})"
            )
    return Workload(spec=spec, digest=workload_digest(spec), source=source)


def load_workload(name_or_path: str | Path, directory: Path = WORKLOADS_DIR) -> Workload:
    """The workload named `name_or_path` (`<directory>/<name>.json`), or the file at that path
    (a value containing `/` or ending in `.json`).

    Raises:
        WorkloadError: no such file, not JSON, not a valid spec, or a name that differs from
            the file's stem.
    """
    text = str(name_or_path)
    path = Path(text) if ("/" in text or text.endswith(".json")) else directory / f"{text}.json"
    try:
        spec = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        known = sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []
        raise WorkloadError(
            f"no workload {text!r}: {path} does not exist (known: {', '.join(known) or 'none'})"
        ) from None
    except json.JSONDecodeError as error:
        raise WorkloadError(f"{path}: not JSON: {error}") from None
    workload = validate_workload(spec, str(path))
    if workload.name != path.stem:
        raise WorkloadError(f"{path}: name: {workload.name!r} differs from the file's stem")
    return workload
