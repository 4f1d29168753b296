"""The parser families' public cases, shipped with the package (``cases/<family>_public.jsonl``).

Each line is a replay case (``inferplane.parsers.cli.replay_case``'s input: ``name``,
``model_output``, ``stream_deltas``, ``thinking``, optional ``tools``) plus ``source`` (the
public suite it comes from: vLLM, SGLang, SMG, or ``derived: ...``), ``expected``
(``reasoning``, ``content``, ``tool_calls``) and, where our contract differs from the public
suite's, a one-line ``note``. The parsers' own tests (``libs/tests/parsers``) replay them at
every split; the conformance gate replays them through a replica's own parser and renderer.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

CASES_PACKAGE = "inferplane.conformance"
CASES_FOLDER = "cases"


def cases_file_name(family: str) -> str:
    """The file name of a family's cases (``kimi_k2`` → ``kimi_k2_public.jsonl``)."""
    return f"{family}_public.jsonl"


def case_families() -> tuple[str, ...]:
    """The families that have a cases file, sorted."""
    folder = resources.files(CASES_PACKAGE) / CASES_FOLDER
    suffix = "_public.jsonl"
    return tuple(
        sorted(p.name.removesuffix(suffix) for p in folder.iterdir() if p.name.endswith(suffix))
    )


@cache
def _load(family: str) -> tuple[dict[str, Any], ...]:
    path = resources.files(CASES_PACKAGE) / CASES_FOLDER / cases_file_name(family)
    if not path.is_file():
        return ()
    text = path.read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def public_cases(family: str) -> list[dict[str, Any]]:
    """The public cases of parser `family` (a registered parser name), in file order; empty
    when the family has no cases file. Each call returns fresh copies (callers may mutate).

    Raises:
        ValueError: a line of the file is not JSON (a packaging error).
    """
    return [json.loads(json.dumps(case)) for case in _load(family)]
