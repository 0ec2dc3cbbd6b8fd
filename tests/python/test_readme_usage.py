"""The Python examples of python/README_USAGE.md run as written."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import textwrap

import pytest

USAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "README_USAGE.md"
BLOCKS = re.findall(r"```python\n(.*?)```", USAGE.read_text(), flags=re.S)


def test_the_examples_are_short():
    assert len(BLOCKS) == 4  # NumPy in five lines, PyTorch in ten, sparse attention's, draft trees'
    numpy_lines, torch_lines = (len(b.strip().splitlines()) for b in BLOCKS[:2])
    assert numpy_lines <= 5 and torch_lines <= 12  # ten, plus the two blank lines


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=["numpy", "torch", "sparse", "tree"])
def test_example_runs(index):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # (a block inside a list item is indented)
        exec(compile(textwrap.dedent(BLOCKS[index]), f"README_USAGE.md block {index}", "exec"), {})
    if index == 0:
        assert printed.getvalue().split() == ["(2,", "8,", "128,", "64)", "[0.", "0.", "0.",
                                              "1.]"]
