"""The replica's test fakes (tests and bench/ only; production code never imports them).

- `pipeline`: `ScriptedEngine` (its `embed` returns `fake_embedding`s), `FakeReplica`,
  `TickingClock`, `serve_inference`, `run_scenario` and the fixture models' specs / assets /
  ids (kimi-tiny; embed-tiny for `embed` replicas; whisper-tiny).
- `node`: `FakeNode`, several fake replicas' servers behind one address, chosen by the
  request's model (tests that serve a chat and an embedding model from one port).

The fake vLLM engines (gRPC `VllmEngine`, the HTTP server) are `inferplane.testing.fake_engine`
and `inferplane.testing.fake_http_engine` (libs/: the node-agent's tests run them too).
"""
