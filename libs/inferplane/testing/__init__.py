"""Test fakes and helpers shared by inferplane test suites (fake clock, loop, databases, replica
and picker fakes, tool-schema strategies, a Kimi-sized vocabulary for grammar tests:
`kimi_vocab`). No production module imports this package.

The node's fakes: `fake_replica` (a replica process's control side, in-process or as
`python -m inferplane.testing.fake_replica` taking the replica's command line), `fake_engine`
(vLLM's gRPC `VllmEngine`) and `fake_http_engine` (vLLM's HTTP server), run as its engine child
or served in-process by the replica's engine-client tests.

The coding agents: `agents` (the pinned Claude Code, Codex CLI and OpenCode configured for an
endpoint in a throw-away directory), `capture_server` (records what a client sends, answering
each chat API with a short reply) and `weather_mcp` (a stdio MCP server with `get_weather`).

A scripted agent session: `agent_session` (tasks, per-turn checks, prefix-cache figures) and
`agent_apis` (its chat, Anthropic Messages and Responses clients on the official SDKs), for
bench/agent_session.py and tests/e2e/test_agent_session.py."""
