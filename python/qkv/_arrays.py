"""What qkv needs to know about the caller's array type: NumPy or PyTorch.

Outputs are allocated in the caller's type (and, for torch, its device and dtype), and
the [batch, heads, seq, dim] <-> [batch, seq, heads, dim] change of layout is a view
(a transpose), never a copy. torch is imported only when the caller already has it.

Half precision: float16 arrays and torch's bfloat16 tensors go to the library as they
are; ml_dtypes' bfloat16 NumPy arrays, which NumPy cannot describe to the binding, go as
int16 views of the same memory with ``bfloat16_bits`` telling the library what the bits
are. The log-sum-exp of a 16-bit call is float32.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._qkv import Error

LAYOUTS = ("bhsd", "bshd")


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


# dtypes the library reads as they are; anything else may be ml_dtypes' bfloat16, whose
# name (dtype.name costs several µs) is then asked.
_NUMPY_PLAIN = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.float16))


def _is_numpy_bfloat16(dtype) -> bool:
    # ml_dtypes.bfloat16 (NumPy has no bfloat16 of its own)
    return dtype not in _NUMPY_PLAIN and dtype.name == "bfloat16"


class NumPy:
    name = "numpy"

    @staticmethod
    def owns(x: Any) -> bool:
        return isinstance(x, np.ndarray)

    @staticmethod
    def empty(shape, like):
        return np.empty(shape, dtype=like.dtype)

    @staticmethod
    def empty_lse(shape, like):
        """The log-sum-exp output: float32 for 16-bit inputs, else like's dtype."""
        return np.empty(shape, dtype=np.float32 if NumPy.is_half(like) else like.dtype)

    @staticmethod
    def swap_axes_1_2(x):
        return x.swapaxes(1, 2)

    @staticmethod
    def for_library(x):
        """x, or for ml_dtypes bfloat16 an int16 view of the same memory."""
        return x.view(np.int16) if _is_numpy_bfloat16(x.dtype) else x

    @staticmethod
    def bfloat16_bits(x) -> bool:
        """Whether a call whose q is x hands the library bfloat16 bits as int16 views."""
        return _is_numpy_bfloat16(x.dtype)

    @staticmethod
    def bits_views(*arrays):
        """The arrays (None kept) with each ml_dtypes bfloat16 one as an int16 view."""
        return tuple(x if x is None else NumPy.for_library(x) for x in arrays)

    @staticmethod
    def is_half(x) -> bool:
        return x.dtype == np.float16 or _is_numpy_bfloat16(x.dtype)

    @staticmethod
    def dtype_name(x) -> str:
        return str(x.dtype)

    @staticmethod
    def is_bool_or_uint8(x) -> bool:
        return x.dtype == np.bool_ or x.dtype == np.uint8

    @staticmethod
    def is_float32(x) -> bool:
        return x.dtype == np.float32

    @staticmethod
    def is_float64(x) -> bool:
        return x.dtype == np.float64

    @staticmethod
    def to_float32(x):
        return x.astype(np.float32)

    @staticmethod
    def add_leading_axes(x, count: int):
        return x.reshape((1,) * count + x.shape)

    @staticmethod
    def integer_vector(values):
        """A contiguous int64 array of `values`, or None if they are not integers."""
        array = np.asarray(values)
        if array.size and array.dtype.kind not in "iu":
            return None
        return np.ascontiguousarray(array, dtype=np.int64)


    @staticmethod
    def float_vector(values):
        array = np.asarray(values)
        if array.dtype.kind not in "iuf" or array.ndim != 1:
            return None
        return np.ascontiguousarray(array, dtype=np.float32)

    @staticmethod
    def random_seed() -> int:
        """A dropout seed from NumPy's global generator (np.random.seed reproduces it)."""
        return int(np.random.randint(0, 2**63 - 1, dtype=np.int64))


class Torch:
    name = "torch"

    @staticmethod
    def owns(x: Any) -> bool:
        return _is_torch_tensor(x)

    @staticmethod
    def empty(shape, like):
        import torch

        return torch.empty(shape, dtype=like.dtype, device=like.device)

    @staticmethod
    def bfloat16_bits(x) -> bool:
        """False: the library reads torch's bfloat16 tensors as they are."""
        return False

    @staticmethod
    def empty_lse(shape, like):
        """The log-sum-exp output: float32 for 16-bit inputs, else like's dtype."""
        import torch

        dtype = torch.float32 if Torch.is_half(like) else like.dtype
        return torch.empty(shape, dtype=dtype, device=like.device)

    @staticmethod
    def swap_axes_1_2(x):
        return x.transpose(1, 2)

    @staticmethod
    def for_library(x):
        """The tensor's memory as the library will read it: for a CPU tensor, its NumPy
        view (.numpy() shares the memory, strides included, and nanobind imports it in
        about a microsecond, where torch's own __dlpack__ costs ~10 µs in Python per
        tensor). Other devices go through DLPack so the library can name the device.
        Detached first: the library records no autograd graph. bfloat16, which NumPy
        cannot hold, goes as an int16 view of the same memory (see storage())."""
        import torch

        x = x.detach()
        if x.device.type != "cpu":
            return x
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        return x.numpy()


    @staticmethod
    def is_half(x) -> bool:
        import torch

        return x.dtype in (torch.bfloat16, torch.float16)

    @staticmethod
    def dtype_name(x) -> str:
        return str(x.dtype)

    @staticmethod
    def inner_contiguous(x):
        """x, or a C-order copy when its last dimension is strided: the library reads
        rows contiguously. (Tensors with no elements are left alone: the module gives
        them C-order strides, as nothing is read.)"""
        if x.stride(-1) == 1 or x.shape[-1] <= 1 or x.numel() == 0:
            return x
        return x.contiguous()

    @staticmethod
    def is_bool_or_uint8(x) -> bool:
        import torch

        return x.dtype in (torch.bool, torch.uint8)

    @staticmethod
    def is_float32(x) -> bool:
        import torch

        return x.dtype == torch.float32

    @staticmethod
    def is_float64(x) -> bool:
        import torch

        return x.dtype == torch.float64

    @staticmethod
    def to_float32(x):
        import torch

        return x.to(torch.float32)

    @staticmethod
    def add_leading_axes(x, count: int):
        return x.reshape((1,) * count + tuple(x.shape))

    @staticmethod
    def integer_vector(values):
        """A contiguous int64 CPU tensor of `values`, or None if they are not integers."""
        import torch

        tensor = torch.as_tensor(values, device="cpu")
        if tensor.numel() and (tensor.is_floating_point() or tensor.is_complex()
                               or tensor.dtype == torch.bool):
            return None
        return tensor.to(torch.int64).contiguous()


def _torch_float_vector(values):
    import torch

    tensor = torch.as_tensor(values, device="cpu")
    if tensor.ndim != 1 or tensor.is_complex() or tensor.dtype == torch.bool:
        return None
    return tensor.to(torch.float32).contiguous()


def _torch_random_seed() -> int:
    """A dropout seed drawn from torch's default generator, so torch.manual_seed
    reproduces a run (as PyTorch's own dropout does)."""
    import torch

    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())


Torch.float_vector = staticmethod(_torch_float_vector)
Torch.random_seed = staticmethod(_torch_random_seed)


def framework_of(function: str, **arrays):
    """NumPy or Torch, the one framework that every given array belongs to."""
    kind = None
    for x in arrays.values():  # the common case: plain arrays of one type
        if x is None:
            continue
        if kind is None:
            kind = type(x)
        elif type(x) is not kind:
            break
    else:
        if kind is np.ndarray:
            return NumPy
        torch = sys.modules.get("torch")
        if torch is not None and kind is torch.Tensor:
            return Torch
    kinds = {}
    for name, x in arrays.items():
        if x is None:
            continue
        if NumPy.owns(x):
            kinds[name] = NumPy
        elif Torch.owns(x):
            kinds[name] = Torch
        else:
            raise TypeError(
                f"{function}: {name}: expected a numpy.ndarray or a torch.Tensor, "
                f"got {type(x).__module__}.{type(x).__qualname__}"
            )
    found = set(kinds.values())
    if len(found) > 1:
        detail = ", ".join(f"{name} is {kind.name}" for name, kind in kinds.items())
        raise TypeError(f"{function}: every array must be of one type ({detail})")
    return found.pop()


def check_layout(function: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise Error(f"{function}: layout: expected 'bhsd' or 'bshd', got {layout!r}")


def axes_names(layout: str) -> str:
    return "[batch, heads, seq, dim]" if layout == "bhsd" else "[batch, seq, heads, dim]"


def check_rank4(function: str, layout: str, **arrays) -> None:
    for name, x in arrays.items():
        if x.ndim != 4:
            raise Error(
                f"{function}: {name}: expected 4 dimensions {axes_names(layout)} "
                f"(layout={layout!r}), got shape {tuple(x.shape)}"
            )


def dims(x, layout: str):
    """(batch, seq, heads, dim) of a 4-D array in `layout`."""
    b, a1, a2, d = x.shape
    return (b, a2, a1, d) if layout == "bhsd" else (b, a1, a2, d)
