"""The node-agent's test fakes (tests and bench/ only; production code never imports them).

- `pipeline`: `ScriptedEngine`, `FakeReplica`, `FakeDirectory`, `TickingClock`,
  `serve_inference`, `run_scenario` and the fixture model's spec / assets / ids.
- `fake_engine`: a fake vLLM gRPC engine (`python -m inferplane.node_agent.testing.fake_engine`).
- `fake_http_engine`: a fake vLLM HTTP server
  (`python -m inferplane.node_agent.testing.fake_http_engine`).
"""
