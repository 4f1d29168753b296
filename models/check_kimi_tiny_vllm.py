"""Serve a built kimi-tiny folder with vLLM (offline ``LLM``, CPU, fp32, eager: as the stack
serves it) and compare greedy outputs of the canonical cases with their expected text.

    PYTHONPATH=libs VLLM_CPU_KVCACHE_SPACE=1 python models/check_kimi_tiny_vllm.py [FOLDER]

Transformers and vLLM compute the same logits only up to float rounding, so a case whose
greedy path has a near-tie can decode differently when served (the reverted 3000-step model
did on URGENT). Per case this prints whether vLLM reproduces it and the smallest margin
(log-probability of the chosen token minus the best other one) along vLLM's greedy path; exits
1 if a case of ``kimi_tiny.RELIABLE_CASES`` (or, with ``--cases``, a named case) is not
reproduced. Prompts are rendered by ``inferplane.chat.render_chat`` and sent as token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from inferplane.fixtures import kimi_tiny as kt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="?", type=Path, default=kt.model_path())
    ap.add_argument(
        "--cases",
        default="",
        help="comma-separated case names that must be reproduced (default: RELIABLE_CASES)",
    )
    args = ap.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from inferplane.chat import render_chat

    folder = str(args.folder.resolve())
    tok = AutoTokenizer.from_pretrained(folder)
    eos = tok.convert_tokens_to_ids(kt.EOS)
    llm = LLM(
        model=folder,
        dtype="float32",
        enforce_eager=True,
        max_model_len=kt.MAX_MODEL_LEN,  # as deployed
        max_num_seqs=16,
        seed=0,
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=200,
        logprobs=2,
        stop_token_ids=[eos],
        skip_special_tokens=False,
    )
    prompts = [
        TokensPrompt(prompt_token_ids=render_chat(c.request(), tok).token_ids) for c in kt.CASES
    ]
    results = llm.generate(prompts, params)
    required = set(args.cases.split(",")) if args.cases else {c.name for c in kt.RELIABLE_CASES}
    report = {}
    failed = []
    for case, res in zip(kt.CASES, results, strict=True):
        out = res.outputs[0]
        ids = [i for i in out.token_ids if i != eos]
        text = tok.decode(ids, skip_special_tokens=False)
        margin, where = float("inf"), -1
        for pos, (tid, lps) in enumerate(zip(out.token_ids, out.logprobs or [], strict=False)):
            others = [lp.logprob for t, lp in lps.items() if t != tid]
            if others and lps[tid].logprob - max(others) < margin:
                margin, where = lps[tid].logprob - max(others), pos
        ok = text == case.output
        report[case.name] = {"ok": ok, "min_margin": round(margin, 3), "at_token": where}
        line = f"{'OK  ' if ok else 'DIFF'} {case.name:26s} min margin {margin:6.3f} at {where}"
        print(line if ok else f"{line}\n     got {text!r}", flush=True)
        if case.name in required and not ok:
            failed.append(case.name)
    ok_names = [n for n, r in report.items() if r["ok"]]
    print(json.dumps({"vllm_reproduced": ok_names, "required_failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
