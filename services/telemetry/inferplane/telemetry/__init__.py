"""inferplane.telemetry: TelemetryService: request records, latency queries and alerts."""
