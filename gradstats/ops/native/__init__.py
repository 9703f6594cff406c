"""Small native CPU kernels, compiled from C on first use with the system's C compiler.

The C sources live beside this file. A kernel is compiled once per source, compiler and CPU
(``-O3 -march=native``, with OpenMP when available) into a cache directory
(``$GRADSTATS_CACHE`` or ``~/.cache/gradstats``), atomically, and loaded with ctypes. When no
compiler is available, or ``GRADSTATS_NATIVE=0``, :func:`load` returns None and callers use
their pure-torch path, which computes the same statistics.

Example:
    >>> from gradstats.ops.native import load
    >>> lib = load("stats")        # a ctypes library, or None without a C compiler
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent


def _cache_dir() -> Path:
    root = os.environ.get("GRADSTATS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "gradstats")
    return Path(root)


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


#: the kernels classify values on their bit patterns and never read floating-point exception
#: flags or errno, so these are safe, and they let the compiler vectorise freely
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fPIC", "-shared", "-std=c99"]


@functools.lru_cache(maxsize=1)
def _flags() -> tuple[str, ...]:
    """:data:`FLAGS`, plus full-width vectors where the CPU has AVX-512 (compilers default to
    256-bit vectors there; the kernels are throughput-bound and gain from the full width)."""
    flags = list(FLAGS)
    try:
        with open("/proc/cpuinfo") as f:
            cpu_flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        cpu_flags = []
    if "avx512f" in cpu_flags and platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")
    return tuple(flags)


def _compile(src: Path, out: Path, cc: str, openmp: bool, defines: tuple[str, ...] = ()) -> bool:
    flags = list(_flags()) + [f"-D{d}" for d in defines]
    if openmp:
        flags.append("-fopenmp")
    else:
        flags.append("-fopenmp-simd")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, str(src), "-lm"], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            log.debug("compiling %s failed: %s", src.name, res.stderr[-2000:])
            return False
        os.replace(tmp, out)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def load(name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled kernel library ``name`` (from ``name.c`` beside this module), or None.

    ``defines``: preprocessor symbols to compile it with (a separate library each), such as
    ``("GS_PORTABLE",)``, which makes ``stats.c`` use its portable loop in plain C instead of its
    AVX-512 loop or its AVX2 loops (for testing that they agree)."""
    if os.environ.get("GRADSTATS_NATIVE", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler found: gradstats uses its pure-torch CPU kernels")
        return None
    src = _HERE / f"{name}.c"
    key = hashlib.sha256(src.read_bytes() + cc.encode() + " ".join(_flags() + defines).encode()
                         + _cpu_tag().encode()).hexdigest()[:16]
    cache = _cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "gradstats-native"
        cache.mkdir(parents=True, exist_ok=True)
    lib_path = cache / f"{name}-{key}.so"
    if not lib_path.exists():
        log.info("compiling the native %s kernel (once) into %s", name, lib_path)
        if not (_compile(src, lib_path, cc, True, defines) or _compile(src, lib_path, cc, False, defines)):
            log.warning("could not compile the native %s kernel; using the pure-torch path", name)
            return None
    try:
        return ctypes.CDLL(str(lib_path))
    except OSError as exc:
        log.warning("could not load %s (%s); using the pure-torch path", lib_path, exc)
        return None


def function(name: str, symbol: str, argtypes: list, defines: tuple[str, ...] = ()) -> Any:
    """The C function ``symbol`` of kernel library ``name`` (compiled with ``defines``) with its
    signature set (returns ``int``), or None when the library is unavailable (see :func:`load`)."""
    lib = load(name, tuple(defines))
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn


def addressable(x: Any) -> bool:
    """Whether the C kernels may read ``x`` by its ``data_ptr()``: a plain tensor or a parameter. A tensor
    subclass (torchao's weight wrappers, for one) may hold no memory of its own (``data_ptr() == 0``):
    the operators take those.

    Example:
        >>> import torch
        >>> addressable(torch.ones(2)), addressable(torch.nn.Parameter(torch.ones(2)))
        (True, True)
    """
    import torch

    return type(x) in (torch.Tensor, torch.nn.Parameter)


def reads_in_place(x: Any) -> bool:
    """Whether a C kernel can read ``x``'s values in place, by its ``data_ptr()``: a non-empty contiguous float32
    CPU tensor that holds its memory (:func:`addressable`). The one tensor check of the statistics kernel
    (:func:`gradstats.stats.kernel_applies`), of a prepared prune + quantise call
    (:meth:`gradstats.ops.fused.NativeCall.takes`) and of apply's hook.

    Example:
        >>> import torch
        >>> reads_in_place(torch.ones(4)), reads_in_place(torch.ones(4, 2).t()), reads_in_place(torch.ones(4).double())
        (True, False, False)
    """
    import torch

    return (x.is_cpu and x.dtype is torch.float32 and x.is_contiguous() and x.numel() > 0 and addressable(x))


@functools.lru_cache(maxsize=1)
def prune_quant() -> Any:
    """``gs_prune_quantize_f32`` of ``prune_quant.c`` with its signature set, or None (see
    :func:`load`): stochastic pruning and rounding of a float32 array in one pass, the CPU path
    of both :func:`gradstats.ops.fused.prune_quantize` and, with rounding off (``quant=0``),
    :func:`gradstats.pruning.stochastic_prune`. Arguments: ``x``, ``out`` (addresses; ``out``
    may be ``x``), ``n``, threshold ``a`` (0 = no pruning), ``scale``, ``quant``,
    ``man_bits``, ``emin``, ``maxv``, ``subnormals``, ``rounding`` (0 nearest, 1 stochastic,
    2 toward zero), ``neg_zero``, ``prune_seed``, ``round_seed`` (the stream seeds of
    :func:`gradstats.ops.random.stream` for pruning and rounding), ``nthreads``, ``counts``
    (address of 5 int64), ``sums`` (address of 6 float64, or None); returns 0, or a negative code for arguments it rejects."""
    return function("prune_quant", "gs_prune_quantize_f32",
                    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float,
                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                     ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p,
                     ctypes.c_void_p])


@functools.lru_cache(maxsize=1)
def prune_quant_blocks() -> Any:
    """``gs_prune_quantize_blocks_f32`` of ``prune_quant.c`` with its signature set, or None (see
    :func:`load`): stochastic pruning and block-scaled rounding (MX's E8M0 scales, NVFP4's E4M3 scales
    under a float32 tensor scale) of a float32 ``(P, K, Q)`` array in one pass, blocks along ``K``: the CPU
    path of :func:`gradstats.ops.fused.prune_quantize` for block-scaled schemes. Arguments: ``x``, ``out``
    (addresses, ``out`` not ``x``), ``P``, ``K``, ``Q``, ``block_size``, threshold ``a``, the element format's
    ``man_bits``, ``emin``, ``maxv``, ``subnormals``, ``rounding``, ``neg_zero`` (as :func:`prune_quant`),
    ``e4m3`` (E4M3 block scales), the E8M0 ``scale_rounding`` code (:data:`gradstats.scheme.SCALE_ROUNDINGS`),
    the element format's ``emax``, ``man_bits`` and ``max``, NVFP4's tensor-scale divisor (``max * 448`` in
    float32), ``tensor_amax`` (negative: the pruned tensor's own), ``prune_seed``, ``round_seed``,
    ``nthreads``, ``counts`` (5 int64), ``sums`` (6 float64); returns 0 or a negative code."""
    return function("prune_quant", "gs_prune_quantize_blocks_f32",
                    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                     ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                     ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
                     ctypes.c_void_p, ctypes.c_void_p])


@functools.lru_cache(maxsize=1)
def prune_f64() -> Any:
    """``gs_stochastic_prune_f64(x, out, n, a, prune_seed, low_seed, nthreads)`` of
    ``prune_quant.c`` (float64 stochastic pruning with 53-bit uniforms from the PRUNE and
    PRUNE_LOW streams of :mod:`gradstats.ops.random`; ``out`` may be ``x``), or None."""
    return function("prune_quant", "gs_stochastic_prune_f64",
                    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_uint64,
                     ctypes.c_uint64, ctypes.c_int])


@functools.lru_cache(maxsize=1)
def random_bits() -> Any:
    """``gs_random_bits(seed, start, n, out)`` of ``prune_quant.c``: the kernel's words of stream
    seed ``seed`` at indices ``start .. start + n - 1`` into ``out`` (uint32 address), or None."""
    lib = load("prune_quant")
    if lib is None:
        return None
    fn = lib.gs_random_bits
    fn.restype = None
    fn.argtypes = [ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return fn


@functools.lru_cache(maxsize=1)
def histogram() -> Any:
    """The functions of ``histogram.c`` with their signatures set, as ``(table_len, build, sparsity,
    threshold, binades, offset)``, or None (see :func:`load`): :class:`gradstats.pruning.LogHistogram`'s tables built
    once (``build(counts, lower, upper, nb, n, n_zero, atoms, na, table)``, addresses of float64 arrays; 0, or
    -1 where the Python class must build them; ``binades(hist, nh, min_exp, n, n_zero, top, nt, min_abs,
    max_abs, table)``: from a statistics row's binade counts, as ``LogHistogram.from_binades``, -2 and -3 its
    two errors), then its expected sparsity (``sparsity(table, a, stochastic)``) and its threshold
    (``threshold(table, target, stochastic)``), the same doubles as the Python class bit for bit;
    ``offset(table, part)``: where its atoms (0) and its bins as given (1) start."""
    lib = load("histogram")
    if lib is None:
        return None
    table_len, build = lib.gs_hist_table_len, lib.gs_hist_build
    table_len.restype, table_len.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int64]
    build.restype = ctypes.c_int
    build.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    sparsity, threshold = lib.gs_hist_sparsity, lib.gs_hist_threshold
    for fn in (sparsity, threshold):
        fn.restype = ctypes.c_double
        fn.argtypes = [ctypes.c_void_p, ctypes.c_double, ctypes.c_int]
    binades = lib.gs_hist_build_binades
    binades.restype = ctypes.c_int
    binades.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_double, ctypes.c_void_p]
    offset = lib.gs_hist_offset
    offset.restype, offset.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int]
    return table_len, build, sparsity, threshold, binades, offset
