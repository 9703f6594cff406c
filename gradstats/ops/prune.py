"""Unbiased stochastic pruning and hard thresholding of tensors, on every engine.

Engines: on the CPU, float32 tensors are pruned by the C kernel that the fused prune/quantise also
runs (``gradstats/ops/native/prune_quant.c``, prune-only), float64 tensors by its float64 twin;
explicit ``uniforms=`` and machines without a C compiler (or with ``GRADSTATS_NATIVE=0``) use the
cache-blocked numpy engine of :mod:`gradstats.ops.cpu`. On CUDA the Triton kernel of :mod:`gradstats.ops.triton.prune` runs when
Triton is installed; everything else (other dtypes, other devices) goes through the plain torch
reference path. All of them draw the one random stream of :mod:`gradstats.ops.random`, so a seed
gives the same result on each. Thresholds for a target sparsity are the analysis stage's
(:func:`gradstats.pruning.threshold`, :func:`gradstats.pruning.prune`).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from gradstats.ops import cpu as _cpu
from gradstats.ops import random as _rng
from gradstats.ops.engine import use_native, use_triton
from gradstats.ops.triton import prune as kprune

__all__ = ["stochastic_prune", "hard_prune", "check_tensor", "check_out", "check_generator"]


def check_tensor(x: Any, what: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{what} must be a floating-point tensor, got dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{what} is empty: there is nothing to prune or estimate from")
    return x


def _check_threshold(threshold: Any) -> float:
    """The threshold as a float; a finite number >= 0 or a ValueError saying so."""
    try:
        a = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}") from None
    if not (math.isfinite(a) and a >= 0):
        raise ValueError(f"threshold must be a finite number >= 0, got {a}")
    return a


def check_out(out: torch.Tensor | None, x: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype \
            or out.device != x.device:
        got = ((tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise ValueError(f"out must be a tensor of x's shape {tuple(x.shape)}, dtype {x.dtype} and "
                         f"device {x.device}; got {got}")


def check_generator(generator: Any) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def stochastic_prune(x: torch.Tensor, threshold: float, *, generator: torch.Generator | None = None,
                     out: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                     seed: int | None = None) -> torch.Tensor:
    """Unbiased stochastic pruning at ``threshold`` ``a``: entries with ``|x| >= a`` are kept;
    each smaller entry becomes ``sign(x) * a`` with probability ``|x| / a`` and 0 otherwise, so
    ``E[T(x)] = x`` and the variance added to an entry is ``a|x| - x^2``.

    ``seed`` (an int in ``[0, 2**64)``) or ``generator`` (one seed is drawn from it; its state
    is advanced; torch's default generator when neither is given) makes the result
    reproducible; ``out`` receives the result (it may be ``x`` itself, for in-place pruning);
    ``uniforms`` (a tensor of ``x``'s shape with values in [0, 1)) replaces the random draws: an
    entry is kept when ``u * a < |x|``. The threshold is first rounded to ``x``'s dtype. Pruned
    entries are zeros of ``x``'s sign; inf is kept, NaN stays NaN. Half-precision tensors are
    computed in float32.

    Random draws: the pruning stream of :mod:`gradstats.ops.random` for the seed, at each
    entry's flat index (``u = (bits >> 8) * 2**-24``; float64 tensors take a 53-bit uniform from
    two words), on every engine: the C kernel shared with :func:`gradstats.ops.fused.prune_quantize`
    (float32 on the CPU; float64 has a C twin), the numpy engine (no C compiler), the Triton kernel (CUDA)
    and the torch reference path (other devices and dtypes) give the same result, bit for bit,
    for the same seed and input, whatever the number of threads.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.tensor([0.5, -0.01, 0.02, -2.0])
        >>> y = stochastic_prune(x, 0.1, generator=g)
        >>> sorted(set(y.abs().tolist()) - {0.0, 2.0, 0.5}) in ([], [0.10000000149011612])
        True
        >>> torch.equal(y, stochastic_prune(x, 0.1, generator=torch.Generator().manual_seed(0)))
        True
    """
    check_tensor(x)
    check_out(out, x)
    check_generator(generator)
    if seed is not None:
        seed = _rng.resolve_seed(seed, generator, "stochastic_prune")
    a = _check_threshold(threshold)
    if uniforms is not None:
        if not isinstance(uniforms, torch.Tensor) or uniforms.shape != x.shape:
            raise ValueError(f"uniforms must be a tensor of x's shape {tuple(x.shape)}")
        uniforms = uniforms.to(device=x.device)
    a = float(torch.tensor(a, dtype=x.dtype)) if x.dtype != torch.float64 else a
    if math.isinf(a):
        a = float(torch.finfo(x.dtype).max)
    if a == 0.0:
        if out is None:
            return x.clone()
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return out
    dev = x.device.type
    if use_native(dev) and x.dtype in (torch.float32, torch.float64):
        xc = x.detach().contiguous().reshape(-1)
        direct = out is not None and out.is_contiguous()
        res = out if direct else torch.empty_like(xc)
        s = _seed(seed, generator) if uniforms is None else None
        if uniforms is None and _cpu.native_kernel() is not None:
            _cpu.native_stochastic_prune(xc.numpy(), a, res.reshape(-1).numpy(), s)
        else:
            u = None
            if uniforms is not None:
                u = uniforms.detach().to(x.dtype).contiguous().reshape(-1).numpy()
            _cpu.stochastic_prune(xc.numpy(), a, res.reshape(-1).numpy(), seed=s, uniforms=u)
        if direct:
            return out  # type: ignore[return-value]
        res = res.reshape(x.shape)
        return out.copy_(res) if out is not None else res
    if use_triton(dev) and x.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return kprune.stochastic_prune(x, a, seed=None if uniforms is not None else _seed(seed, generator),
                                       uniforms=uniforms, out=out)
    return kprune.stochastic_prune_torch(x, a, uniforms=uniforms, out=out,
                                         seed=None if uniforms is not None else _seed(seed, generator))


def _seed(seed: int | None, generator: torch.Generator | None) -> int:
    """The call's seed: ``seed`` (validated) or one draw from ``generator``."""
    return seed if seed is not None else _rng.draw_seed(generator)


def hard_prune(x: torch.Tensor, threshold: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Deterministic hard thresholding: ``x`` where ``|x| >= threshold``, else 0 (biased).
    NaN and inf are kept; ``out`` may be ``x``.

    Example:
        >>> import torch
        >>> hard_prune(torch.tensor([0.5, 0.01, -2.0]), 0.1).tolist()
        [0.5, 0.0, -2.0]
    """
    check_tensor(x)
    check_out(out, x)
    a = _check_threshold(threshold)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        xc = x.detach().contiguous().reshape(-1)
        direct = out is not None and out.is_contiguous()
        res = out if direct else torch.empty_like(xc)
        _cpu.hard_prune(xc.numpy(), a, res.reshape(-1).numpy())
        if direct:
            return out  # type: ignore[return-value]
        res = res.reshape(x.shape)
        return out.copy_(res) if out is not None else res
    res = torch.where(x.abs() < a, torch.zeros_like(x), x)
    return out.copy_(res) if out is not None else res
