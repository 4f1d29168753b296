"""`python -m inferplane.replica ...` (see `settings.py` for the command line).

Everything stays under the `__main__` guard: vLLM spawns its EngineCore with multiprocessing,
which re-imports this module as `__mp_main__` (notes/vllm_inproc_probe.md, pitfall 2).
"""

if __name__ == "__main__":
    from inferplane.replica.app import main

    raise SystemExit(main())
