"""examples/mla_absorbed.py: a tiny DeepSeek-V3 whose attention layers run the absorbed form
over latent caches through qkv.mla_decode (prompt and decode steps alike) generates the same
greedy tokens as transformers' eager model, contiguous and paged caches; with --fused each
layer's step is one qkv.BatchPlan call that rotates k_pe and q_pe (DeepSeek's pairs), writes
both pools and attends (float32 and bfloat16 pools)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "mla_absorbed.py"


def load_example():
    spec = importlib.util.spec_from_file_location("mla_absorbed_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra", [[], ["--paged", "--batch", "3"], ["--fused"],
                                   ["--fused", "--paged", "--batch", "3", "--cache-dtype", "bfloat16"]])
def test_absorbed_mla_generates_eager_tokens(extra, capsys):
    assert load_example().main(["--tokens", "8", *extra]) == 0
    assert "same tokens as transformers' eager DeepSeek-V3: yes" in capsys.readouterr().out
