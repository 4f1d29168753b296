"""Build the fixture LoRA adapter ``kimi-tiny-lora`` for ``models/kimi-tiny`` (issue 29).

    python models/build_lora_fixture.py [--out DIR] [--seed N]

A PEFT-format LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, rank 8,
alpha 16) on every attention and MLP projection of both layers (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``: the modules vLLM's Qwen2
LoRA support packs into ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``), trained so
that the model answers every prompt of ``inferplane.fixtures.kimi_tiny_lora.TRAIN_REQUESTS``
with ``ADAPTER_OUTPUT`` (a reasoning sentence, ``</think>``, a distinctive reply, then
``<|im_end|>``). The base model's weights are only read: its greedy outputs are unchanged.

Deterministic: fixed seed (``--seed``, default 1234; other seeds give the variants the LoRA
benchmark serves side by side), fixed step count, 2 torch threads, training in float64 (the
per-step rounding differences of CPU kernels stay around 1e-16) and the trained factors rounded
to float16's grid before they are written as float32, so the same torch/transformers versions
write the same bytes. ``MANIFEST.json`` records every file's sha256, the shape, the training
facts and the versions (no wall time). The script then checks, under transformers in float32,
that the base model with the adapter merged decodes ``ADAPTER_OUTPUT`` greedily on every
training prompt with a top-1/top-2 log-prob margin of at least ``MIN_MARGIN``, and that the
base model alone still decodes the canonical ``NO_TOOL`` answer; it exits 1 otherwise.

Nothing is downloaded; a build takes ~6 s on 2 CPU cores (~10 s with the imports).
models/README.md has the details.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fixture_build import folder_digests, library_versions, publish, write_json  # noqa: E402

from inferplane.fixtures import kimi_tiny as kt  # noqa: E402
from inferplane.fixtures import kimi_tiny_lora as kl  # noqa: E402

THREADS = 2
STEPS = 60
LEARNING_RATE = 5e-3
MIN_MARGIN = 2.0
"""Smallest top-1/top-2 log-prob margin along every greedy adapter path the build accepts:
wide enough that vLLM's float32 CPU kernels (punica's CPU LoRA ops) decode the same text."""


def render(tokenizer: Any, request: dict[str, Any]) -> list[int]:
    """The prompt ids the platform serves for `request` (``inferplane.chat.render_chat``)."""
    from inferplane.chat import render_chat

    return list(render_chat(request, tokenizer).token_ids)


class LoraLinear:
    """A frozen `torch.nn.Linear` plus a trainable rank-`r` update (PEFT's LoRA):
    ``y = W x + (alpha / r) * B (A x)``; `A` is r × in, `B` out × r (zeros at the start, so
    training starts from the base model)."""

    def __init__(self, base: Any, rank: int, alpha: int, generator: Any) -> None:
        import torch

        self.base = base
        self.scale = alpha / rank
        fan_in = base.in_features
        bound = 1.0 / fan_in**0.5
        a = (torch.rand(rank, fan_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound
        self.a = torch.nn.Parameter(a)
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank, dtype=torch.float64))

    def __call__(self, x: Any) -> Any:
        return self.base(x) + self.scale * ((x @ self.a.T) @ self.b.T)


def attach(model: Any, rank: int, alpha: int, seed: int) -> dict[str, LoraLinear]:
    """Wraps every target projection of `model` with a `LoraLinear` (in module order, each
    drawing its `A` from one generator seeded `seed`); returns them by PEFT module name."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    wrapped: dict[str, LoraLinear] = {}
    for layer_index, layer in enumerate(model.model.layers):
        for parent_name, parent in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for name in kl.TARGET_MODULES:
                base = getattr(parent, name, None)
                if base is None:
                    continue
                lora = LoraLinear(base, rank, alpha, generator)
                parent.__dict__[name] = lora  # shadows the registered submodule in forward
                wrapped[f"model.layers.{layer_index}.{parent_name}.{name}"] = lora
    return wrapped


def batch(
    tokenizer: Any, requests: Sequence[dict[str, Any]], target: list[int]
) -> tuple[Any, Any, Any]:
    """Right-padded input ids, attention mask and labels (-100 except on `target`)."""
    import torch

    rows = [render(tokenizer, r) + target for r in requests]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        labels[i, len(row) - len(target) : len(row)] = torch.tensor(target)
    return ids, mask, labels


def train(model: Any, tokenizer: Any, seed: int) -> tuple[dict[str, LoraLinear], float]:
    """Trains the adapter on `kl.TRAIN_REQUESTS` → `kl.ADAPTER_OUTPUT`; returns the LoRA
    layers and the final loss (mean cross-entropy per target token)."""
    import torch

    for p in model.parameters():
        p.requires_grad_(False)
    layers = attach(model, kl.RANK, kl.ALPHA, seed)
    target = tokenizer.encode(kl.ADAPTER_OUTPUT + kt.EOS, add_special_tokens=False)
    ids, mask, labels = batch(tokenizer, kl.TRAIN_REQUESTS, target)
    params = [p for lora in layers.values() for p in (lora.a, lora.b)]
    optimizer = torch.optim.Adam(params, lr=LEARNING_RATE)
    loss = torch.tensor(0.0)
    scored = labels[:, 1:] != -100  # logits only where a target token is predicted
    expected = labels[:, 1:][scored]
    for _ in range(STEPS):
        optimizer.zero_grad()
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model.lm_head(hidden[:, :-1][scored])
        loss = torch.nn.functional.cross_entropy(logits, expected)
        loss.backward()
        optimizer.step()
    return layers, float(loss.detach())


def tensors(layers: dict[str, LoraLinear]) -> dict[str, Any]:
    """PEFT's checkpoint names (``base_model.model.<module>.lora_A.weight`` / ``lora_B``) →
    float32 tensors rounded to float16's grid (see the module docstring)."""
    import torch

    out: dict[str, Any] = {}
    for name, lora in layers.items():
        for part, value in (("lora_A", lora.a), ("lora_B", lora.b)):
            grid = value.detach().to(torch.float16).to(torch.float32).contiguous()
            out[f"base_model.model.{name}.{part}.weight"] = grid
    return out


def adapter_config() -> dict[str, Any]:
    """``adapter_config.json`` as PEFT writes it for a plain LoRA (the fields vLLM's
    `PEFTHelper` reads, and PEFT's defaults for the rest)."""
    return {
        "base_model_name_or_path": kt.SERVED_MODEL_NAME,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_alpha": kl.ALPHA,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": kl.RANK,
        "target_modules": list(kl.TARGET_MODULES),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def greedy(model: Any, prompt: list[int], max_tokens: int, eos: int) -> tuple[list[int], float]:
    """Greedy decoding with transformers: the generated ids (eos excluded) and the smallest
    top-1/top-2 log-prob margin along the path."""
    import torch

    ids = list(prompt)
    out: list[int] = []
    margin = float("inf")
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            top = torch.log_softmax(logits, -1).topk(2)
            margin = min(margin, float(top.values[0] - top.values[1]))
            token = int(top.indices[0])
            if token == eos:
                break
            out.append(token)
            ids.append(token)
    return out, margin


def check(folder: Path, tokenizer: Any) -> dict[str, Any]:
    """Reloads the written adapter into a float32 copy of kimi-tiny (weights merged:
    ``W + alpha/r * B A``) and checks the greedy outputs (see the module docstring).

    Raises:
        SystemExit: an output differs or a margin is under MIN_MARGIN (exit code 1).
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    eos = tokenizer.convert_tokens_to_ids(kt.EOS)
    base = AutoModelForCausalLM.from_pretrained(str(kt.model_path()), dtype=torch.float32).eval()
    no_tool = render(tokenizer, kt.NO_TOOL.request())
    base_ids, _ = greedy(base, no_tool, 64, eos)
    if tokenizer.decode(base_ids) != kt.NO_TOOL.output:
        raise SystemExit(f"the base model no longer decodes NO_TOOL: {tokenizer.decode(base_ids)}")
    weights = load_file(str(folder / kl.WEIGHTS_FILE))
    config = json.loads((folder / kl.CONFIG_FILE).read_text())
    scale = config["lora_alpha"] / config["r"]
    merged = AutoModelForCausalLM.from_pretrained(str(kt.model_path()), dtype=torch.float32).eval()
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for key, a in weights.items():
            if ".lora_A." not in key:
                continue
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = weights[key.replace(".lora_A.", ".lora_B.")]
            modules[name].weight += scale * (b @ a)
    margins = []
    for request in kl.TRAIN_REQUESTS:
        ids, margin = greedy(merged, render(tokenizer, request), 64, eos)
        text = tokenizer.decode(ids)
        if text != kl.ADAPTER_OUTPUT or margin < MIN_MARGIN:
            raise SystemExit(f"adapter output {text!r} (margin {margin:.2f}) for {request}")
        margins.append(margin)
    return {"adapter_min_margin": round(min(margins), 2), "base_no_tool_unchanged": True}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "models" / kl.FOLDER_NAME)
    ap.add_argument("--seed", type=int, default=kl.SEED, help="initialisation seed")
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    torch.manual_seed(args.seed)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(str(kt.model_path()))
    model = AutoModelForCausalLM.from_pretrained(str(kt.model_path()), dtype=torch.float64)
    layers, loss = train(model, tokenizer, args.seed)
    out: Path = args.out
    staging = Path(tempfile.mkdtemp(prefix="kimi-tiny-lora-"))
    try:
        weights = tensors(layers)
        save_file(weights, str(staging / kl.WEIGHTS_FILE), metadata={"format": "pt"})
        write_json(staging / kl.CONFIG_FILE, adapter_config())
        publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    facts = check(out, tokenizer)
    files = folder_digests(out)
    base_manifest = json.loads((kt.model_path() / "MANIFEST.json").read_text())
    manifest = {
        "name": kl.FOLDER_NAME,
        "base_model": kt.SERVED_MODEL_NAME,
        "base_weights_sha256": base_manifest["sha256"]["model.safetensors"],
        "rank": kl.RANK,
        "alpha": kl.ALPHA,
        "target_modules": list(kl.TARGET_MODULES),
        "parameters": sum(t.numel() for t in weights.values()),
        "size_bytes": sum((out / f).stat().st_size for f in files),
        "build_command": "python models/build_lora_fixture.py"
        + (f" --seed {args.seed}" if args.seed != kl.SEED else ""),
        "seed": args.seed,
        "steps": STEPS,
        "learning_rate": LEARNING_RATE,
        "final_loss": round(loss, 6),
        "adapter_output": kl.ADAPTER_OUTPUT,
        **facts,
        "versions": library_versions(),
        "sha256": files,
    }
    write_json(out / "MANIFEST.json", manifest)  # no wall time: rebuilds compare bytes
    summary = {k: manifest[k] for k in ("parameters", "size_bytes", "final_loss")}
    print(json.dumps({**summary, **facts, "build_seconds": round(time.monotonic() - started, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
