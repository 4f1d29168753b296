"""Trims a GuideLLM 0.8 JSON report for a committed test fixture."""

import json, sys

d = json.load(open(sys.argv[1]))
b = d["benchmarks"][0]
for k in ("successful", "incomplete", "errored"):
    b["requests"][k] = b["requests"][k][:1]
for k in ("text", "turns", "image", "video", "audio", "tool_call"):
    b["metrics"].pop(k, None)
json.dump(d, open(sys.argv[2], "w"), indent=None, separators=(",", ":"))
