"""The gRPC service base: the server runner, the error root and its interceptor, settings
loading, the `/metrics` text endpoint and garbage-collector hygiene.

The underscored modules are imported through `inferplane.runtime` (its re-exports);
`metrics_http` is imported by path.
"""
