"""The conformance gate's library (issue 30 §2): what a replica's RunConformance checks and how
a release scores it.

- replay: a parser family's public cases (`public_cases`, shipped as package data) through a
  replica's own parser and renderer (`replay`);
- live: seeded requests with random tool schemas under `tool_choice` auto / required / named
  (`live_requests`), scored as the K2 Vendor Verifier counts (`LiveTally`);
- the verdict: `ConformanceThresholds` (the profile's `ReleaseGates`, defaults defined here)
  `.check(report) -> (passed, reason)`, and `score(report, gates)`.

Pure Python over the protos (no grpc server, no engine): the replica process runs it
(`inferplane.replica.server.conformance`), the orchestrator's gate scores its report.
"""

from inferplane.conformance._cases import case_families, cases_file_name, public_cases
from inferplane.conformance._live import (
    AUTO_MAX_TOKENS,
    FORCED_MAX_TOKENS,
    TOOL_CHOICES,
    LiveRequest,
    LiveTally,
    family_markers,
    live_requests,
    random_tools,
)
from inferplane.conformance._replay import (
    MAX_FAILURES,
    Render,
    ReplayResult,
    declared_names,
    parse_problem,
    render_problem,
    replay,
)
from inferplane.conformance._thresholds import (
    DEFAULT_LIVE_REQUESTS,
    DEFAULT_MAX_LEAKED_MARKERS,
    DEFAULT_MIN_REPLAY_PASS_RATE,
    DEFAULT_MIN_SCHEMA_VALID_RATE,
    DEFAULT_MIN_TOOL_CALL_RATE,
    DEFAULT_TIMEOUT_SECONDS,
    ConformanceThresholds,
    replay_pass_rate,
    schema_valid_rate,
    score,
    tool_call_rate,
)

__all__ = [
    "AUTO_MAX_TOKENS",
    "DEFAULT_LIVE_REQUESTS",
    "DEFAULT_MAX_LEAKED_MARKERS",
    "DEFAULT_MIN_REPLAY_PASS_RATE",
    "DEFAULT_MIN_SCHEMA_VALID_RATE",
    "DEFAULT_MIN_TOOL_CALL_RATE",
    "DEFAULT_TIMEOUT_SECONDS",
    "FORCED_MAX_TOKENS",
    "MAX_FAILURES",
    "TOOL_CHOICES",
    "ConformanceThresholds",
    "LiveRequest",
    "LiveTally",
    "Render",
    "ReplayResult",
    "case_families",
    "cases_file_name",
    "declared_names",
    "family_markers",
    "live_requests",
    "parse_problem",
    "public_cases",
    "random_tools",
    "render_problem",
    "replay",
    "replay_pass_rate",
    "schema_valid_rate",
    "score",
    "tool_call_rate",
]
