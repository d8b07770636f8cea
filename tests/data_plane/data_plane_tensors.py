"""Tensors for the data-plane tests: random values that use a dtype's range, and an exact comparison."""

from __future__ import annotations

import torch


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values of `dtype` that use its range (so a lossy cast would change them)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` is a dense tensor equal to `want` in dtype, shape and every value."""
    assert isinstance(got, torch.Tensor) and not got.is_nested
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(got, want)
