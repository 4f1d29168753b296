"""The node-agent's test fakes (tests and bench/ only; production code never imports them).

- `pipeline`: `ScriptedEngine` (its `embed` returns `fake_embedding`s), `FakeReplica`,
  `FakeDirectory`, `TickingClock`, `serve_inference`, `run_scenario` and the fixture models'
  specs / assets / ids (kimi-tiny; embed-tiny for `embed` replicas).
- `fake_engine`: a fake vLLM gRPC engine (`python -m inferplane.node_agent.testing.fake_engine`).
- `fake_http_engine`: a fake vLLM HTTP server (completions and embeddings)
  (`python -m inferplane.node_agent.testing.fake_http_engine`).
"""
