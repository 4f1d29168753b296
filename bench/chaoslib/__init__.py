"""The chaos bench's machinery (`bench/chaos.py` is the entry point), one module per job:

- `streams.py`: one streamed request on each API (chat, Anthropic Messages, Responses) and
  either protocol (HTTP/1.1, HTTP/2), and how it ended (`Request.outcome`);
- `load.py`: `Load`, the closed loops of streams plus a probe that a fault hits;
- `ledger.py`: `UsageLedger`, what auth accounted (its `usage_accounted` lines);
- `processes.py`: the engine core's pid, a supervisor's restart, Envoy's retries, PostgreSQL;
- `faults.py`: `FAULTS`, each fault's trigger and follow-up;
- `phase.py`: `Phase` and `run_fault`, one fault under the load → a `Row`;
- `report.py`: `Row`, the table, the evidence and the last lines.
"""
