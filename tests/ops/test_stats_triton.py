"""The Triton statistics kernel, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1), against
the C kernel (the torch reference where the C kernel is not built): counts, extremes, binade
histogram, top magnitudes and per-block counts equal, sums to float32 rounding. Small inputs: the
interpreter is slow."""
from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradstats.stats.blocks import BLOCK_SIZES, RANGE_BINS, blocks_stats
from gradstats.stats.fields import LAYOUT, VECTOR_LEN
from gradstats.stats.kernel import VectorRows, has_native_kernel, write_stats
from gradstats.stats.reference import reduce

triton = pytest.importorskip("triton")

from gradstats.ops.triton import stats as ks  # noqa: E402

EXACT = [LAYOUT[k] for k in ("n", "n_zero", "n_nonfinite", "min_abs", "max_abs", "hist", "top_abs")]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns on the lanes that overflow
        yield
    torch.set_num_threads(n)


def expected(x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """The statistics vector and block counts of ``x`` as float32 from the C kernel (the torch
    reference and :func:`blocks_stats` without it)."""
    xf = x.detach().cpu().float().contiguous().reshape(-1)
    if has_native_kernel():
        rows, counts = VectorRows(), np.zeros((2, 1 + RANGE_BINS), np.int64)
        write_stats(xf, rows.claim(), blocks=counts)
        return torch.from_numpy(rows.take()[0].copy()), counts
    counts = np.array([[r["n_zero_blocks"], *r["range_hist"]] for r in blocks_stats(xf, BLOCK_SIZES)], np.int64)
    return reduce(xf), counts


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def double_sums(x: torch.Tensor) -> tuple[list[float], list[float]]:
    """The five sums of ``x`` in float64 and the scale of each (the sum of the magnitudes of its terms)."""
    d = x.detach().cpu().double().reshape(-1)
    d = d[torch.isfinite(d)]
    lg = d.abs()[d != 0].log()
    sums = [d.sum(), d.abs().sum(), d.square().sum(), lg.sum(), lg.square().sum()]
    scales = [d.abs().sum(), d.abs().sum(), d.square().sum(), lg.abs().sum(), lg.square().sum()]
    return [float(s) for s in sums], [float(s) for s in scales]


def check(x: torch.Tensor, sums: bool = True) -> torch.Tensor:
    """Compare :func:`stats_vector` of ``x`` (and its block counts) with :func:`expected`; the sums
    with those of ``x`` in float64 unless ``sums`` is False (float32 squares that overflow)."""
    blocks = torch.full((2, 1 + RANGE_BINS), -7, dtype=torch.int64, device=x.device)   # overwritten
    got = ks.stats_vector(x, blocks=blocks)
    assert got.dtype == torch.float64 and got.shape == (VECTOR_LEN,) and got.device == x.device
    want, want_blocks = expected(x)
    got = got.cpu()
    for sl in EXACT:
        assert same(got[sl], want[sl]), (sl, got[sl], want[sl])
    np.testing.assert_array_equal(blocks.cpu().numpy(), want_blocks)
    if not sums:
        return got
    sums, scales = double_sums(x)
    slack = x.numel() * 2.0 ** -126          # float32 terms that underflow (squares of tiny entries)
    for i, (s, scale) in enumerate(zip(sums, scales)):
        assert abs(float(got[LAYOUT["sum"].start + i]) - s) <= 1e-5 * scale + slack, (i, got[3 + i], s)
    return got


def lognormal(n: int, seed: int = 0, sigma: float = 4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    # heavy tails: a few channels on scales far apart
    scale = torch.exp2(torch.randint(-30, 30, (n,), generator=g).float() * (torch.rand(n, generator=g) < 0.01))
    return sign * torch.exp(torch.randn(n, generator=g) * sigma) * scale


def special(n: int, seed: int = 1) -> torch.Tensor:
    """Lognormal entries with many zeros, float32 subnormals, +-inf and NaN mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = lognormal(n, seed)
    u = torch.rand(n, generator=g)
    x = torch.where(u < 0.4, 0.0, x)
    x = torch.where((u >= 0.4) & (u < 0.45), 1e-42 * torch.randint(1, 1000, (n,), generator=g).float(), x)
    x = torch.where((u >= 0.45) & (u < 0.46), 2.0 ** -149, x)
    x = torch.where((u >= 0.46) & (u < 0.47), torch.tensor([math.inf, -math.inf, math.nan])[
        torch.randint(0, 3, (n,), generator=g)], x)
    return x


def test_the_layout_is_the_declared_one():
    """The constants the kernel writes by are those of the statistics' declaration."""
    from gradstats.stats import blocks, fields

    assert fields.SCALAR_FIELDS == ks.SCALARS == ("n", "n_zero", "n_nonfinite", "sum", "sum_abs", "sum_sq",
                                                  "sum_ln_abs", "sum_ln_abs_sq", "min_abs", "max_abs")
    assert fields.LAYOUT["hist"] == slice(ks.N_SCALARS, ks.N_SCALARS + ks.HIST_BINS)
    assert fields.LAYOUT["top_abs"] == slice(ks.N_SCALARS + ks.HIST_BINS, ks.VECTOR_LEN)
    assert (ks.HIST_BINS, ks.HIST_MIN_EXP, ks.TOP_K, ks.VECTOR_LEN) == (
        fields.HIST_BINS, fields.HIST_MIN_EXP, fields.TOP_K, fields.VECTOR_LEN)
    assert (ks.BLOCK_SIZES, ks.RANGE_BINS) == (blocks.BLOCK_SIZES, blocks.RANGE_BINS)


def test_supports(interpret, monkeypatch):
    monkeypatch.setenv("GRADSTATS_ENGINE", "triton")      # the CPU takes the device path only when asked
    assert ks.supports(torch.ones(3)) and ks.supports(torch.ones(2, 3, dtype=torch.bfloat16))
    assert ks.supports(torch.ones(3, dtype=torch.float16))
    assert not ks.supports(torch.ones(0))
    assert not ks.supports(torch.ones(3, dtype=torch.float64))
    assert not ks.supports(torch.ones(3, dtype=torch.int32))
    assert not ks.supports(torch.ones(4, 4).t())


def test_supports_is_false_on_the_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ks.supports(torch.ones(3))


@pytest.mark.parametrize("n", [1, 15, 17, 33, 4097, 50_001])
def test_sizes_not_a_multiple_of_the_tile(interpret, n):
    check(special(n, seed=n))


def test_lognormal_with_heavy_tails(interpret):
    v = check(lognormal(50_001, seed=3, sigma=5.0).reshape(7, 7143))
    assert v[LAYOUT["n_zero"]].item() == 0 and not math.isnan(v[LAYOUT["top_abs"]][-1].item())


def test_many_zeros_and_subnormals(interpret):
    x = special(20_000, seed=4)
    x[: 5000] = 0.0
    x[5000: 6000] = 1e-42
    v = check(x)
    assert v[LAYOUT["min_abs"]].item() == 2.0 ** -149
    assert v[LAYOUT["hist"]][0].item() > 0                                   # the binade of 2**-149


def test_all_zero_and_all_nonfinite_tensors(interpret):
    v = check(torch.zeros(5000))
    assert v[:3].tolist() == [5000.0, 5000.0, 0.0] and v[LAYOUT["top_abs"]].isnan().all()
    assert math.isnan(v[LAYOUT["min_abs"]].item()) and v[LAYOUT["hist"]].sum().item() == 0
    v = check(torch.tensor([math.inf, -math.inf, math.nan] * 11))
    assert v[:3].tolist() == [33.0, 0.0, 33.0] and v[LAYOUT["sum"]].item() == 0.0
    check(-torch.zeros(40))


def test_a_single_value(interpret):
    for value in (-3.5, 1e-42, 3.4e38, 0.0, math.nan):
        v = check(torch.tensor([value]), sums=value != 3.4e38)
        if value not in (0.0,) and not math.isnan(value):
            assert v[LAYOUT["top_abs"]][0].item() == abs(torch.tensor(value).item())
            assert v[LAYOUT["max_abs"]].item() == v[LAYOUT["min_abs"]].item()


def test_ties_and_sorted_order_in_the_top(interpret):
    """Many equal magnitudes (the tile's 64th largest repeated) and the largest all in the last tile."""
    check(torch.ones(10_000))
    x = torch.ones(9000)
    x[::97] = 2.0
    x[5::300] = -3.0
    check(x)
    check(torch.arange(1, 12_001, dtype=torch.float32))                     # ascending: the top in the last tile
    check(torch.arange(12_000, 0, -1, dtype=torch.float32).reshape(3, 4000))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(interpret, dtype):
    x = special(9_001, seed=5)
    if dtype is torch.float16:
        x = x * 1e-3                                  # float16 subnormals (below 6.1e-5), overflow to inf
        x[::50] = 7e4
    check(x.to(dtype))


def test_blocks_follow_memory_order(interpret):
    """Blocks of 16 and 32 from element 0: a tiny entry in every fourth block of 16, a zero block,
    a block of subnormals only, the last block partial."""
    x = torch.ones(16 * 40 + 5)
    x[::64] = 2.0 ** -20
    x[32:48] = 0.0
    x[96:112] = 1e-40
    x[200:216] = 2.0 ** 60
    blocks = torch.zeros(2, 1 + RANGE_BINS, dtype=torch.int64)
    ks.stats_vector(x, blocks=blocks)
    # 41 blocks of 16: 2 without a normal entry, 10 of range 20 (the eleventh tiny one shares its block
    # with 2**60); 21 blocks of 32
    assert blocks.sum(1).tolist() == [41, 21] and blocks[0, 0].item() == 2 and blocks[0, 1 + 20].item() == 10
    check(x)


def test_out_is_written_in_place(interpret):
    buf = torch.full((3, VECTOR_LEN), -1.0, dtype=torch.float64)
    x = special(3000, seed=6)
    r = ks.stats_vector(x, out=buf[1])
    assert r.data_ptr() == buf[1].data_ptr()
    assert same(buf[1], ks.stats_vector(x)) and (buf[0] == -1).all() and (buf[2] == -1).all()
    cols = torch.full((VECTOR_LEN, 3), -1.0, dtype=torch.float64)          # a strided column, strided blocks
    blocks = torch.full((1 + RANGE_BINS, 2), -1, dtype=torch.int64).t()
    ks.stats_vector(x, out=cols[:, 2], blocks=blocks)
    assert same(cols[:, 2], buf[1]) and (cols[:, :2] == -1).all()
    np.testing.assert_array_equal(blocks.numpy(), expected(x)[1])


def test_bad_input_is_refused_with_the_fix(interpret):
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ks.stats_vector(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="non-empty"):
        ks.stats_vector(torch.ones(0))
    with pytest.raises(ValueError, match="contiguous"):
        ks.stats_vector(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="out must be a float64 tensor"):
        ks.stats_vector(torch.ones(3), out=torch.zeros(VECTOR_LEN))
    with pytest.raises(ValueError, match="blocks must be an int64 tensor"):
        ks.stats_vector(torch.ones(3), blocks=torch.zeros(2, 64, dtype=torch.int64))


@pytest.mark.parametrize("rows, chunk", [(1, 64), (4, 256)])
def test_the_combine_loops_over_any_number_of_tiles(interpret, monkeypatch, rows, chunk):
    """The combine reads the tiles' partials in chunks: chunks smaller than the 13 tiles of 50_001
    entries (and than their 832 top candidates) give the same vector, the largest magnitudes and the
    ties spread over several chunks."""
    monkeypatch.setattr(ks, "_ROWS", rows)
    monkeypatch.setattr(ks, "_CHUNK", chunk)
    check(special(50_001, seed=12))
    check(torch.arange(1, 50_002, dtype=torch.float32))                       # the top in the last chunk
    x = torch.ones(50_001)
    x[::1001] = -2.0                                         # 50 values above ties in every tile
    v = check(x)
    assert v[LAYOUT["top_abs"]].tolist() == [2.0] * 50 + [1.0] * 14


class _Launches:
    """Counts kernel launches (Triton's ``run``, interpreted or compiled) and whether one is running."""

    def __init__(self, monkeypatch) -> None:
        from triton.runtime import interpreter, jit

        self.count = 0
        self.depth = 0
        for cls in (interpreter.InterpretedFunction, getattr(jit, "JITFunction", None)):
            if cls is not None and hasattr(cls, "run"):
                monkeypatch.setattr(cls, "run", self._wrap(cls.run))

    def _wrap(self, run):
        def counted(fn, *args, **kwargs):
            self.count += 1
            self.depth += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self.depth -= 1
        return counted


class _OutsideLaunches(TorchDispatchMode):
    """Records the non-view ATen ops made outside a launch (the interpreter copies a launch's arguments)
    with the tensors each reads."""

    def __init__(self, launches: _Launches) -> None:
        super().__init__()
        self.launches = launches
        self.calls: list[tuple[str, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view and self.launches.depth == 0:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            self.calls.append((str(func), [t for t in leaves if isinstance(t, torch.Tensor)]))
        return func(*args, **kwargs)


def test_one_call_is_two_launches_and_two_allocations(interpret, monkeypatch):
    """The pass and the combine are the only kernels; outside them a call allocates its zero-filled
    scratch (the atomic counts, the partials) and, without ``out``, the vector: no other ATen op."""
    x = special(50_001, seed=13).reshape(7, 7143)
    out = torch.empty(VECTOR_LEN, dtype=torch.float64)
    blocks = torch.empty(2, 1 + RANGE_BINS, dtype=torch.int64)
    ks.stats_vector(x)                                        # compiled (rewritten) before counting
    for kwargs, allocations in (({"out": out, "blocks": blocks}, ["aten.zeros.default"]),
                                ({}, ["aten.zeros.default", "aten.empty.memory_format"])):
        launches = _Launches(monkeypatch)
        ops = _OutsideLaunches(launches)
        with ops:
            v = ks.stats_vector(x, **kwargs)
        assert launches.count == 2
        assert [name for name, _ in ops.calls] == allocations, ops.calls
        assert not any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                       for _, ts in ops.calls for t in ts)
        want = expected(x)[0]
        assert all(same(v[sl], want[sl]) for sl in EXACT)


class _Ops(TorchDispatchMode):
    """Records each ATen op with the largest tensor it reads or writes, except views and the ops
    Triton's interpreter makes to move kernel arguments to the host and back (a CUDA launch makes none)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and not self._interpreter():
            leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
            self.calls.append((str(func), max([t.numel() for t in leaves if isinstance(t, torch.Tensor)],
                                              default=0)))
        return out

    @staticmethod
    def _interpreter() -> bool:
        f = sys._getframe(1)
        while f is not None:
            if f.f_code.co_filename.replace("\\", "/").endswith("triton/runtime/interpreter.py"):
                return True
            f = f.f_back
        return False


def test_no_whole_tensor_op_and_no_host_synchronisation(interpret):
    x = special(50_001, seed=7).reshape(3, 16_667)
    blocks = torch.zeros(2, 1 + RANGE_BINS, dtype=torch.int64)
    out = torch.zeros(VECTOR_LEN, dtype=torch.float64)
    ops = _Ops()
    with ops:
        ks.stats_vector(x, out=out, blocks=blocks)
    names = [name for name, _ in ops.calls]
    assert ops.calls and not any(n.startswith(("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select",
                                               "aten.index.Tensor", "aten.unique", "aten._unique"))
                                 for n in names), names
    big = [(name, size) for name, size in ops.calls if size >= x.numel() / 2]
    assert not big, big
    assert sum(size for _, size in ops.calls) < x.numel() / 4, ops.calls   # the partials are small
    want = expected(x)[0]
    assert all(same(out[sl], want[sl]) for sl in EXACT)


@pytest.mark.gpu
def test_kernel_on_cuda():
    for x in (special(50_001, seed=8), lognormal(1_000_003, seed=9), torch.zeros(100), torch.tensor([1e-42]),
              special(9_001, seed=10).to(torch.bfloat16), (special(9_001, seed=11) * 1e-3).to(torch.float16)):
        check(x.cuda())
