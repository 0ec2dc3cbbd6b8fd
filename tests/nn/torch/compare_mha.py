"""qkv::nn::MultiHeadAttention against PyTorch with the same weights.

Usage: compare_mha.py <qkv_nn_torch_case executable> <work directory>

The C++ helper writes one safetensors file per case (configuration in the metadata;
weights, inputs, masks, the upstream gradient, and qkv's output and gradients). For each
case this script rebuilds the layer in PyTorch with those weights: torch.nn.MultiheadAttention
where it applies, and for grouped-query attention (which that module lacks) the same
projections around F.scaled_dot_product_attention(enable_gqa=True). It then compares the
output and the gradients of every input and parameter.

Tolerances:
  float64 cases: |qkv − torch| ≤ 1e-10 (both are float64 throughout; they differ only by
    summation order, ~1e-15 relative on O(1) values, so 1e-10 is loose yet catches any
    wrong term, which is O(1)).
  float32 cases: both are measured against torch in float64 on the same inputs, and
    qkv's error must be at most 2× torch float32's own error + 1e-6 (the rule
    FlashAttention's tests use: no worse than twice the peer's error).

Exits 77 (ctest: skipped) when torch or numpy cannot be imported.
"""
import json
import pathlib
import subprocess
import sys

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as error:  # pragma: no cover - depends on the machine
    print(f"skipped: {error}")
    sys.exit(77)

DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64}


def read_safetensors(path):
    """A reader written from the format's specification, independent of qkv's."""
    data = pathlib.Path(path).read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    metadata = header.pop("__metadata__", {})
    body = data[8 + length :]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        array = np.frombuffer(body[begin:end], dtype=DTYPES[entry["dtype"]])
        tensors[name] = array.reshape(entry["shape"]).copy()
    return metadata, tensors


def leaf(array, dtype):
    return torch.tensor(array, dtype=dtype, requires_grad=True)


def run_torch(meta, t, dtype):
    """Forward + backward in torch; returns (out, {name: grad})."""
    E = int(meta["embed_dim"])
    H = int(meta["num_heads"])
    Hkv = int(meta["num_kv_heads"])
    kdim, vdim = int(meta["key_dim"]), int(meta["value_dim"])
    bias = meta["bias"] == "1"
    self_attention = meta["self"] == "1"
    mask = meta["mask"]

    query = leaf(t["query"], dtype)
    key = query if self_attention else leaf(t["key"], dtype)
    value = query if self_attention else leaf(t["value"], dtype)
    B, Nq, Nk = query.shape[0], query.shape[1], key.shape[1]
    weights = {n: leaf(t[n], dtype) for n in t if n.endswith((".weight", ".bias")) and not n.startswith("grad.")}

    # Boolean masks in torch's two conventions: MultiheadAttention's True = "masked out",
    # scaled_dot_product_attention's True = "takes part".
    allowed = torch.ones(Nq, Nk, dtype=torch.bool)
    if mask == "causal":
        allowed = torch.tril(allowed)
    elif mask == "keep":
        allowed = torch.tensor(t["keep"] != 0)
    padding = None
    if mask == "padding":
        lengths = torch.tensor(t["key_lengths"])
        padding = torch.arange(Nk)[None, :] >= lengths[:, None]  # True = padded key

    if Hkv == H:
        mha = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True, dtype=dtype)
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                mha.in_proj_weight.copy_(torch.cat([weights[f"{p}_proj.weight"] for p in "qkv"]))
            else:
                mha.q_proj_weight.copy_(weights["q_proj.weight"])
                mha.k_proj_weight.copy_(weights["k_proj.weight"])
                mha.v_proj_weight.copy_(weights["v_proj.weight"])
            if bias:
                mha.in_proj_bias.copy_(torch.cat([weights[f"{p}_proj.bias"] for p in "qkv"]))
                mha.out_proj.bias.copy_(weights["out_proj.bias"])
            mha.out_proj.weight.copy_(weights["out_proj.weight"])
        out, _ = mha(query, key, value, key_padding_mask=padding,
                     attn_mask=None if mask in ("none", "padding") else ~allowed, need_weights=False)
        out.backward(torch.tensor(t["dout"], dtype=dtype))
        grads = {"out_proj.weight": mha.out_proj.weight.grad}
        if mha._qkv_same_embed_dim:
            for i, p in enumerate("qkv"):
                grads[f"{p}_proj.weight"] = mha.in_proj_weight.grad[i * E : (i + 1) * E]
        else:
            for p in "qkv":
                grads[f"{p}_proj.weight"] = getattr(mha, f"{p}_proj_weight").grad
        if bias:
            for i, p in enumerate("qkv"):
                grads[f"{p}_proj.bias"] = mha.in_proj_bias.grad[i * E : (i + 1) * E]
            grads["out_proj.bias"] = mha.out_proj.bias.grad
    else:
        d = E // H
        w = weights
        b = (lambda n: w[n]) if bias else (lambda n: None)
        q = F.linear(query, w["q_proj.weight"], b("q_proj.bias")).view(B, Nq, H, d).transpose(1, 2)
        k = F.linear(key, w["k_proj.weight"], b("k_proj.bias")).view(B, Nk, Hkv, d).transpose(1, 2)
        v = F.linear(value, w["v_proj.weight"], b("v_proj.bias")).view(B, Nk, Hkv, d).transpose(1, 2)
        sdpa_mask = allowed[None, None]
        if padding is not None:
            sdpa_mask = sdpa_mask & ~padding[:, None, None, :]
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, enable_gqa=True)
        out = F.linear(context.transpose(1, 2).reshape(B, Nq, E), w["out_proj.weight"], b("out_proj.bias"))
        out.backward(torch.tensor(t["dout"], dtype=dtype))
        grads = {n: p.grad for n, p in w.items()}

    grads["query"] = query.grad
    if not self_attention:
        grads["key"] = key.grad
        grads["value"] = value.grad
    return out.detach(), {n: g.detach() for n, g in grads.items()}


def max_error(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)), initial=0.0))


def check_case(path):
    meta, t = read_safetensors(path)
    names = ["out"] + [n[len("grad.") :] for n in t if n.startswith("grad.")]
    qkv = {"out": t["out"], **{n[len("grad.") :]: t[n] for n in t if n.startswith("grad.")}}
    failures = []
    if meta["dtype"] == "float64":
        out, grads = run_torch(meta, t, torch.float64)
        theirs = {"out": out, **grads}
        worst = 0.0
        for n in names:
            error = max_error(qkv[n], theirs[n])
            worst = max(worst, error)
            if error > 1e-10:
                failures.append(f"{n}: max |qkv − torch| = {error:.3g} > 1e-10")
        summary = f"float64, max |qkv − torch| = {worst:.2g}"
    else:
        out64, grads64 = run_torch(meta, t, torch.float64)
        out32, grads32 = run_torch(meta, t, torch.float32)
        reference = {"out": out64, **grads64}
        torch32 = {"out": out32, **grads32}
        ratio = 0.0
        for n in names:
            ours = max_error(qkv[n], reference[n])
            theirs = max_error(torch32[n], reference[n])
            ratio = max(ratio, ours / max(theirs, 1e-12))
            if ours > 2 * theirs + 1e-6:
                failures.append(f"{n}: qkv error {ours:.3g} > 2 × torch float32 error {theirs:.3g} + 1e-6")
        summary = f"float32, worst qkv/torch error ratio vs float64 = {ratio:.2f}"
    return failures, summary


def main():
    helper, work = sys.argv[1], pathlib.Path(sys.argv[2])
    subprocess.run([helper, str(work)], check=True)
    torch.manual_seed(0)
    passed = failed = 0
    for path in sorted(work.glob("*.safetensors")):
        failures, summary = check_case(path)
        if failures:
            failed += 1
            print(f"FAIL {path.stem}: " + "; ".join(failures))
        else:
            passed += 1
            print(f"ok   {path.stem} ({summary})")
    if passed + failed == 0:
        print("no cases were written")
        return 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
