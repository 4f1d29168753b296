"""At-least-once delivery of per-request facts (records to telemetry, usage to auth) off the
request path: the bounded, batched, retrying `Batcher` (`batching`) and its durable overflow on
local SQLite (`spool`).
"""
