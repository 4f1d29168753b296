"""At-least-once delivery of per-request facts off the request path: the bounded, batched,
retrying `Batcher` (`batching`: records to telemetry, outcomes to pickers) and the write-ahead
`Outbox` (`outbox`: usage to auth) over its local SQLite file (`spool`), which a crash or an
outage of the receiver does not empty.
"""
