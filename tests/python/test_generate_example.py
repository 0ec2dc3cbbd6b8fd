"""examples/generate.py runs and its qkv-cache decode loop gives the same tokens (and
logits within 1e-4) as full causal SDPA without a cache, for every cache kind."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("torch")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "generate.py"


def load_example():
    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra", [[], ["--paged", "--cache-dtype", "float16", "--block-size", "7"],
                                   ["--cache-dtype", "float32", "--batch", "3"]])
def test_generate_example_matches_uncached_generation(extra, capsys):
    assert load_example().main(["--tokens", "10", *extra]) == 0
    assert "same tokens as full causal SDPA without a cache: yes" in capsys.readouterr().out
