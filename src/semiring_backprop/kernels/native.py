"""The signed max-times contraction as native code (``native.cpp``): a kernel blocked
like a GEMM (a register tile of rows by vectors of columns; two multiplies, two max and
two min per multiply-add a real product would make), with AVX-512 or AVX2 where this CPU
has it; and TopK's k-best max-plus contraction (:func:`maxplus_kbest`: the k largest
sums per output kept as it goes, most candidates rejected by one compare).

Built on first use, not at install: the C++ file is compiled with the machine's compiler
(``$CXX``, else ``c++`` or ``g++``; a few seconds) for this CPU's vector width
(``torch.backends.cpu.get_cpu_capability()``) into a cache directory
(``$SEMIRING_BACKPROP_CACHE``, else ``~/.cache/semiring_backprop``), once per source,
flags and compiler; later processes load it (``SEMIRING_BACKPROP_KERNEL_FLAGS``: more
flags, e.g. ``-mno-avx512f`` to build and test the AVX2 kernel on an AVX-512 machine).
It is on unless ``SEMIRING_BACKPROP_NATIVE=0`` (:func:`enabled`). Where no compiler is
found, or compiling fails, or it is off, :func:`maxtimes` returns None and
:func:`..kernels.maxtimes` runs its torch kernels (the same values: tests compare
them). The weights are packed into the kernel's panels once, with the prepared weights
of a pass (:func:`pack`, from ``MaxProduct.prepare``, kept across calls), and on every
call only where they were not prepared.

It runs only where it computes what the torch kernels compute: CPU tensors with memory
of their own (not batched by ``torch.vmap``), float32 or float64, every value finite
but the semiring's zero (``hi = -inf``, ``lo = +inf``); its vector max and min do not
propagate NaN, so a NaN or an infinity among the values or weights goes to the torch
kernels, which do. Rows are split over ``torch.get_num_threads()`` threads (the call
releases the GIL), so the library's thread settings hold for it too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.cpp")
INF = float("inf")
#: rows per thread below which one thread runs the whole call
MIN_ROWS_PER_THREAD = 8
_FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}


def enabled() -> bool:
    """On unless ``SEMIRING_BACKPROP_NATIVE=0`` (or ``false``): the same values as the
    torch kernels, in a third to a half of their time in a whole pass
    (docs/performance.md, "The max-times kernel")."""
    return os.environ.get("SEMIRING_BACKPROP_NATIVE", "1").strip().lower() not in ("0", "false")


def compiler() -> str | None:
    """The C++ compiler the kernel is built with (None: none found)."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def capability() -> str:
    """The vector width the kernel is built for: ``AVX512``, ``AVX2`` or ``DEFAULT``."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512") and _x86():
        return "AVX512"
    return "AVX2" if cap.startswith("AVX") and _x86() else "DEFAULT"


def _x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64")


def _cache_dir() -> Path:
    root = os.environ.get("SEMIRING_BACKPROP_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "semiring_backprop"


@functools.cache
def library():
    """The loaded kernel (ctypes), built first if no build of this source, flags and
    compiler is cached; None where it cannot be built (the reason is logged once)."""
    if not enabled():
        return None
    cxx = compiler()
    if cxx is None:
        log.info("no C++ compiler found: the max-times kernel runs in torch")
        return None
    extra = os.environ.get("SEMIRING_BACKPROP_KERNEL_FLAGS", "").split()
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
             *_FLAGS.get(capability(), []), *extra]  # fmt: skip
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cxx, *flags]).encode()).hexdigest()
    target = _cache_dir() / f"maxtimes-{capability().lower()}-{key[:16]}.so"
    if not target.exists():
        try:
            _build(cxx, flags, target)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("the max-times kernel did not build (%s): it runs in torch", e)
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        log.warning("the max-times kernel did not load (%s): it runs in torch", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("sbp_maxtimes_f32", "sbp_maxtimes_f64"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr]
        fn.restype = None
    lib.sbp_tile_width.argtypes, lib.sbp_tile_width.restype = [i64], i64
    for name in ("sbp_maxplus_kbest_f32", "sbp_maxplus_kbest_f64"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr]
        fn.restype = None
    lib.sbp_kbest_max.argtypes, lib.sbp_kbest_max.restype = [], i64
    return lib


def _build(cxx: str, flags: list, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(out)], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        if done.returncode:
            raise subprocess.SubprocessError(done.stderr.strip()[-2000:] or "no output")
        os.replace(out, target)  # (another process's build of the same file: the same bytes)
    log.info("built the max-times kernel: %s", target)


@functools.cache
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="sbp-maxtimes")


def _has_storage(t) -> bool:
    """Memory of its own (not batched by ``torch.vmap``): what a pointer can be read of."""
    try:
        t.untyped_storage()
    except NotImplementedError:
        return False
    return True


class Packed(NamedTuple):
    """Contraction weights as the native kernel reads them, made once per weight
    (``MaxProduct.prepare``, kept across calls with the prepared weights): the packed
    panels (B, p / width, m, width) of the transposed weights (..., p, m), the leading
    dims flattened into B; ``shape`` the transposed weights' shape. The panels alone
    are kept (no second copy): :meth:`unpack` remakes the transposed weights for the
    torch kernels where the native one does not take the values."""

    panels: torch.Tensor
    shape: torch.Size

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    def unpack(self) -> torch.Tensor:
        """The transposed weights (..., p, m) the panels were made from."""
        b, tiles, m, width = self.panels.shape
        wt = self.panels.transpose(-1, -2).reshape(b, tiles * width, m)
        return wt[:, : self.shape[-2]].reshape(self.shape).contiguous()


def _panels(wt, width: int) -> torch.Tensor:
    """(B, p, m) transposed weights as packed panels, (B, tiles, m, width): a tile reads
    its weights in order; columns past p are 0."""
    b, p, m = wt.shape
    pp = -(-p // width) * width
    padded = wt.new_zeros(b, pp, m)  # (columns, inner), 0 past p
    padded[:, :p] = wt
    return padded.view(b, pp // width, width, m).transpose(-1, -2).contiguous()


def pack(wt: torch.Tensor) -> Packed | None:
    """``wt`` (..., p, m) packed, where the native kernel is built and takes these
    weights (CPU, float32 / float64, every weight finite); None otherwise (the caller
    keeps ``wt``: the torch kernels read it as it is)."""
    if wt.device.type != "cpu" or wt.dim() < 2 or 0 in wt.shape:  # (no build for these)
        return None
    lib = library()
    if lib is None or not _weights_fit(wt):
        return None
    wt = wt.detach()
    width = int(lib.sbp_tile_width(wt.element_size()))
    return Packed(_panels(wt.reshape(-1, *wt.shape[-2:]), width), wt.shape)


def _weights_fit(wt) -> bool:
    if wt.device.type != "cpu" or wt.dtype not in (torch.float32, torch.float64):
        return False
    return _has_storage(wt) and bool(torch.isfinite(wt).all())


def _values_fit(hi, lo, dtype) -> bool:
    """Whether the native kernel computes what the torch kernels compute on these
    values, against weights of ``dtype`` (checked already)."""
    if hi.device.type != "cpu" or lo.dtype != hi.dtype or dtype != hi.dtype:
        return False
    if not (_has_storage(hi) and _has_storage(lo)):
        return False
    if hi.dtype == torch.float32 and hi.shape[-1] >= 2**24:  # float indices: exact below
        return False
    live = hi != -INF
    return bool((torch.isfinite(hi) & torch.isfinite(lo) | ~live & (lo == INF)).all())


def _shared(wt) -> bool:
    """Whether the (B, p, m) weights are one matrix for every batch (a broadcast)."""
    return wt.shape[0] == 1 or wt.stride(0) == 0


def maxtimes(hi, lo, wt, argmax: bool):
    """:func:`..kernels.maxtimes` on flattened (B, n, m) fields and (B, p, m) transposed
    weights: ``(out_hi, j_hi, out_lo, j_lo)`` (``argmax``) or ``(out_hi, out_lo)``; None
    where the native kernel is not built or does not fit these tensors. The weights are
    packed on every call (one matrix where every batch reads the same)."""
    if hi.device.type != "cpu" or 0 in hi.shape or wt.shape[-2] == 0:  # (no build for these)
        return None
    lib = library()
    if lib is None or not _weights_fit(wt) or not _values_fit(hi, lo, wt.dtype):
        return None
    width = int(lib.sbp_tile_width(hi.element_size()))
    return _run(lib, hi, lo, _panels(wt[:1] if _shared(wt) else wt, width), wt.shape[-2], argmax)


def maxtimes_packed(hi, lo, packed: Packed, argmax: bool):
    """:func:`..kernels.maxtimes` on fields (..., n, m) and :func:`pack`'s weights, the
    batch dims broadcast; None where the native kernel does not fit these values or this
    broadcast (the caller runs the torch kernels on ``packed.unpack()``)."""
    lib = library()
    lead = tuple(packed.shape[:-2])
    batch = torch.broadcast_shapes(hi.shape[:-2], lo.shape[:-2], lead)
    if lib is None or (math.prod(lead) != 1 and tuple(batch) != lead):
        return None
    b = math.prod(batch)
    hi, lo = (f.expand(*batch, *f.shape[-2:]).reshape(b, *f.shape[-2:]) for f in (hi, lo))
    if 0 in hi.shape or not _values_fit(hi, lo, packed.dtype):
        return None
    outs = _run(lib, hi, lo, packed.panels, packed.shape[-2], argmax)
    return tuple(o.reshape(*batch, *o.shape[-2:]) for o in outs)


def _over_rows(run, rows: int) -> None:
    """``run(r0, r1)`` over disjoint ranges of ``rows`` on ``torch.get_num_threads()``
    threads (the C calls release the GIL), at least ``MIN_ROWS_PER_THREAD`` rows each."""
    threads = max(1, min(torch.get_num_threads(), rows // MIN_ROWS_PER_THREAD))
    if threads == 1:
        run(0, rows)
        return
    step = -(-rows // threads)
    jobs = [_pool(threads).submit(run, r, min(r + step, rows)) for r in range(0, rows, step)]
    for job in jobs:
        job.result()


def _run(lib, hi, lo, panels, p: int, argmax: bool):
    """The C kernel on (B, n, m) fields and (1 or B, tiles, m, width) panels of p
    columns."""
    b, n, m = hi.shape
    item = hi.element_size()
    pp = panels.shape[1] * panels.shape[3]
    hs, ls = hi.contiguous(), lo.contiguous()
    live = (hs != -INF).all(-1).to(torch.uint8).reshape(-1)  # rows with a path everywhere
    # (out_hi, out_lo[, j_hi, j_lo]): the C function's order
    outs = [torch.empty(b * n, pp, dtype=hi.dtype) for _ in range(4 if argmax else 2)]
    fn = lib.sbp_maxtimes_f32 if item == 4 else lib.sbp_maxtimes_f64
    w_batch = 0 if panels.shape[0] == 1 else m * pp
    ptrs = [t.data_ptr() for t in outs] + ([] if argmax else [None, None])

    def run(r0, r1):
        data = (hs.data_ptr(), ls.data_ptr(), panels.data_ptr(), live.data_ptr())
        fn(*data, n, m, pp, w_batch, r0, r1, *ptrs)

    _over_rows(run, b * n)
    got = [t.view(b, n, pp)[..., :p] for t in outs]
    if not argmax:
        return tuple(got)
    return got[0], got[2].long(), got[1], got[3].long()


def maxplus_kbest(m, lwt, k: int):
    """The ``k`` largest of ``m[b, i, j] + lwt[b, l, j]`` over ``j`` for (B, n, L) log
    magnitudes and (B or 1, p, L) transposed log weights: ``(values, indices, decided)``,
    (B, n, p, k) each and (B, n, p) (:func:`..kernels.maxplus_topk`'s compiled kernels'
    contract: where ``decided`` is False, a tie or too few finite sums leaves the k best
    to be ranked again); None where the kernel is not built or does not take these (a
    NaN or +inf among them, k past 8, not float32 / float64 on a CPU)."""
    b, n, L = m.shape
    p = lwt.shape[-2]
    if 0 in (b, n, L, p) or m.device.type != "cpu" or lwt.device.type != "cpu":
        return None
    lib = library()
    if lib is None or not 1 <= k <= int(lib.sbp_kbest_max()):
        return None
    if m.dtype not in (torch.float32, torch.float64) or lwt.dtype != m.dtype:
        return None
    if m.dtype == torch.float32 and L >= 2**24:  # float indices: exact below
        return None
    if not (_has_storage(m) and _has_storage(lwt)):
        return None
    if bool((m.isnan() | (m == INF)).any() or (lwt.isnan() | (lwt == INF)).any()):
        return None
    width = int(lib.sbp_tile_width(m.element_size()))
    pp = -(-p // width) * width
    panels = _panels(lwt[:1] if _shared(lwt) else lwt, width)
    ms = m.contiguous()
    best = torch.empty(b * n, pp, k, dtype=m.dtype)
    idx = torch.empty(b * n, pp, k, dtype=m.dtype)
    ok = torch.empty(b * n, pp, dtype=torch.uint8)
    fn = lib.sbp_maxplus_kbest_f32 if m.element_size() == 4 else lib.sbp_maxplus_kbest_f64
    w_batch = 0 if panels.shape[0] == 1 else L * pp

    def run(r0, r1):
        fn(ms.data_ptr(), panels.data_ptr(), n, L, pp, w_batch, r0, r1, k,
           best.data_ptr(), idx.data_ptr(), ok.data_ptr())  # fmt: skip

    _over_rows(run, b * n)
    cut = (b, n, pp)
    return (best.view(*cut, k)[:, :, :p], idx.view(*cut, k)[:, :, :p].long(),
            ok.view(cut)[:, :, :p].bool())  # fmt: skip


def built() -> str:
    """What :func:`library` loaded, in words (for benchmarks and bug reports)."""
    lib = library()
    if lib is None:
        return "not built (the torch kernels run)"
    return f"{capability()} build ({compiler()}), python {sys.version.split()[0]}"
