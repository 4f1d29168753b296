"""The replica process: one engine replica serving `InferenceService` on its own port. Run it
with `python -m inferplane.replica` (`settings.py`).

Modules: `app` (`ReplicaProcess`, `main`, exit codes), `settings` (`ReplicaSettings`,
`parse_args`), `state` (`ReplicaState`, `TrackedEngine`, `Phase`), `hosts` (`InprocHost`,
`ChildEngineHost`), `service` (ReplicaProcessService); packages: `server` (InferenceService),
`pipeline`, `engines`, `testing` (fakes). Nothing is imported here: vLLM's
EngineCore re-imports the `__main__` module's package when it is spawned, and should not pay
for the pipeline's imports.
"""
