"""N-gram speculation on the CPU runner (issue 30): the check behind
`inferplane.engine_features.CHECKED_SPECULATIVE_METHODS` listing "ngram" for vllm-cpu.

One real vLLM engine (this interpreter's vllm-cpu) serves kimi-tiny (fp32, eager) with the
`--speculative-config` the platform builds for `speculative_method: ngram` (defaults: 4
tokens, window 4..1), greedy, on four canonical cases. It must start, propose drafts, and
return exactly the greedy outputs (speculation changes speed, never the text). About 30 s
on 2 cores (vllm-cpu 0.32.0: 26 s to start, 2 s to generate).

The engine runs in a child interpreter (this file as a script): vLLM's engine core is a
spawned process, which needs a real `__main__`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = 4  # canonical cases generated (kimi_tiny.RELIABLE_CASES[:4])


@pytest.mark.e2e
def test_ngram_speculation_runs_on_vllm_cpu_and_keeps_greedy_outputs() -> None:
    pytest.importorskip("vllm")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    report = json.loads(lines[-1])
    assert report["matched"] == report["cases"] == CASES, report
    assert report["drafts"] > 0 and report["draft_tokens"] > 0, report


def _run() -> None:
    repo = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(repo / "libs"))
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from inferplane import engine_features
    from inferplane.chat import render_chat
    from inferplane.fixtures import kimi_tiny as kt

    folder = str(kt.model_path())
    tok = AutoTokenizer.from_pretrained(folder)
    eos = tok.convert_tokens_to_ids(kt.EOS)
    llm = LLM(
        model=folder,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=4,
        seed=0,
        speculative_config=engine_features.Speculation("ngram").engine_config(),
        disable_log_stats=False,
    )
    cases = list(kt.RELIABLE_CASES)[:CASES]
    params = SamplingParams(
        temperature=0.0, max_tokens=200, stop_token_ids=[eos], skip_special_tokens=False
    )
    prompts = [
        TokensPrompt(prompt_token_ids=render_chat(c.request(), tok).token_ids) for c in cases
    ]
    results = llm.generate(prompts, params)
    matched = 0
    for case, result in zip(cases, results, strict=True):
        ids = [i for i in result.outputs[0].token_ids if i != eos]
        matched += tok.decode(ids, skip_special_tokens=False) == case.output
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    report = {
        "cases": len(cases),
        "matched": matched,
        "drafts": metrics.get("vllm:spec_decode_num_drafts") or 0,
        "draft_tokens": metrics.get("vllm:spec_decode_num_draft_tokens") or 0,
        "accepted_tokens": metrics.get("vllm:spec_decode_num_accepted_tokens") or 0,
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    _run()
