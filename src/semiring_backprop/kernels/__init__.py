"""Fused semiring matmuls: max-times (sign-aware, with argmax) and max-plus (with argmax);
and max-plus top-k (the k best with their indices), eager. On a CPU, max-times runs as
native code blocked like a GEMM where a compiler built it (:mod:`.native`; the formulas
below otherwise, with the same values).

``torch.compile`` turns each into one loop nest that never materializes the (n, m, p)
broadcast (CPU and CUDA alike); shapes are dynamic, so one compilation serves every
size. Otherwise the same formulas run eagerly in row chunks under a memory budget. Both
paths compute the same values; tests compare them.

When to compile (:func:`set_compile`, or ``SEMIRING_BACKPROP_COMPILE`` = ``auto``,
``1``, ``0``): a compilation costs seconds (about 4 s on a CPU once torch's on-disk
caches are warm, twice that the first time on a machine), so by default (``auto``) a
kernel runs eagerly until the eager work it has done in this process would have paid
for compiling it, then compiles (never more than twice the better choice's time, known
only in hindsight): a single explanation runs eagerly, a data set compiles early on.
``1`` compiles at once, ``0`` never; small problems always run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings

import torch

from ..errors import NonFiniteError, is_out_of_memory

log = logging.getLogger(__name__)

INF = float("inf")

#: below this many (row, inner, column) triples a kernel runs eagerly: a compiled call
#: costs about 0.1 ms more, the eager broadcast several ns per triple
MIN_WORK = 2**15
#: seconds one compilation costs (``auto``: compile once eager work would have paid it)
COMPILE_COST_S = 4.0
#: seconds of eager work per (row, inner, column) triple, by device type
_EAGER_S_PER_TRIPLE = {"cpu": 8e-9, "cuda": 2e-11}  # measured: BERT, 2-core CPU

_MODES = {"auto": "auto", "1": True, "0": False}
_state = {
    "compile": _MODES.get(os.environ.get("SEMIRING_BACKPROP_COMPILE", "auto").lower(), "auto"),
    "failed": set(),
    "frozen": False,  # no new compilation (see no_new_compiles)
    "eager_s": {},  # kernel key -> estimated seconds of eager work done so far
}


def chunk_rows(n: int, per_row: int, budget: int = 2**24) -> int:
    """How many rows of a contraction to expand at once under an element budget."""
    return max(1, min(n, budget // max(per_row, 1)))


def set_compile(enabled: bool | str) -> None:
    """Compile kernels once eager work would have paid for it (``"auto"``, default),
    always (``True``), or never (``False``: the chunked eager ones)."""
    if enabled != "auto":
        enabled = bool(enabled)
    _state["compile"] = enabled


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` has memory of its own: not a tensor batched by ``torch.vmap``
    (a batched pass: many values per node, see ``circuits.edges``), into which
    an unbatched tensor may not be written in place, and which runs no compiled kernel."""
    try:
        t.untyped_storage()
    except NotImplementedError:
        return False
    return True


@contextlib.contextmanager
def no_new_compiles():
    """Within the block, kernels that have run compiled still do and no other compiles
    (a pass being captured as a CUDA graph must not compile: compiling launches work)."""
    before = _state["frozen"]
    _state["frozen"] = True
    try:
        yield
    finally:
        _state["frozen"] = before


def _should_compile(key, work: int, device) -> bool:
    mode = _state["compile"]
    if not mode or not work or work < MIN_WORK or key in _state["failed"]:
        return False
    if key in _COMPILED_KEYS:
        return True
    if _state["frozen"]:
        return False
    if mode is True:
        return True
    spent = _state["eager_s"].get(key, 0.0) + work * _EAGER_S_PER_TRIPLE.get(device.type, 8e-9)
    _state["eager_s"][key] = spent
    return spent >= COMPILE_COST_S


def _first(hit):
    """Index of the first True along the last dim.

    A max over float ranks: unlike ``argmax``, it vectorizes (float32 counts exactly
    to 2**24, whatever the values' dtype).
    """
    m = hit.shape[-1]
    rank = m - torch.arange(m, dtype=torch.float32, device=hit.device)
    return (m - (hit.to(torch.float32) * rank).amax(-1)).long()


def _maxtimes(hs, ls, pen, wt):
    """(B, n, m) fields x (B, p, m) weights (transposed) -> (B, n, p): max / min over m
    of the sign-aware products, with the first arg-max / arg-min.

    ``hs``, ``ls`` hold 0 where there is no path and ``pen`` holds -inf there (0
    elsewhere), so that no ``0 * inf`` arises. For a path, ``hi >= lo``, so the
    sign-aware candidate ``w * (hi if w >= 0 else lo)`` is ``max(w * hi, w * lo)``: no
    branch in the loop.
    """
    w = wt[:, None, :, :]
    a, b, p = hs[:, :, None, :] * w, ls[:, :, None, :] * w, pen[:, :, None, :]
    ch = torch.maximum(a, b) + p
    cl = torch.minimum(a, b) - p
    hi = ch.amax(-1, keepdim=True)
    lo = cl.amin(-1, keepdim=True)
    return hi[..., 0], _first(ch >= hi), lo[..., 0], _first(cl <= lo)


def _maxtimes_values(hs, ls, pen, wt):
    """:func:`_maxtimes` without the arg-max / arg-min (the same values)."""
    w = wt[:, None, :, :]
    a, b, p = hs[:, :, None, :] * w, ls[:, :, None, :] * w, pen[:, :, None, :]
    return (torch.maximum(a, b) + p).amax(-1), (torch.minimum(a, b) - p).amin(-1)


def _maxplus(m, lwt):
    """(B, n, m) x (B, p, m) (transposed) -> max over m of m + lw, and its first arg-max."""
    c = m[:, :, None, :] + lwt[:, None, :, :]
    best = c.amax(-1, keepdim=True)
    return best[..., 0], _first(c >= best)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a compiled kernel reads it with the fewest programs: contiguous, with
    the strides of its sizes (a dim of size 1 may have any stride: guarded on), from
    the start of its storage (a view's offset and base are guarded on: each offset of
    0, 1 or more, and each base's layout, was a program of its own), without
    autograd's flag (guarded on too). (Sizes of 1 are still specialized: marked unbacked
    instead, every size ran one program, but about three times slower.)"""
    t = t.detach()
    if not t.is_contiguous() or t.storage_offset():
        t = t.clone(memory_format=torch.contiguous_format)
    strides = [1] * t.dim()
    for d in range(t.dim() - 2, -1, -1):
        strides[d] = strides[d + 1] * t.shape[d + 1]
    if list(t.stride()) != strides:  # (a dim of size 1 may have any stride: guarded on)
        t = t.as_strided(t.shape, strides).detach()
    return t


def zero_masked(hi, lo):
    """The max-times kernels' fields: 0 in place of the zero's infinities, and the
    penalty (-inf at the zero, 0 elsewhere)."""
    dead = hi == -INF
    pen = torch.zeros_like(hi).masked_fill(dead, -INF)
    return hi.masked_fill(dead, 0), lo.masked_fill(dead, 0), pen


def _masked(kernel):
    """``kernel`` on raw fields, :func:`zero_masked` made inside: compiled, it is loops over
    the fields fused into the program, not three tensors made before it."""

    def run(hi, lo, wt):
        return kernel(*zero_masked(hi, lo), wt)

    return run


_EAGER = {"maxtimes": _maxtimes, "maxtimes_values": _maxtimes_values, "maxplus": _maxplus}
#: what is compiled in place of an eager kernel: the max-times ones with their masking
_WHOLE = {"maxtimes": _masked(_maxtimes), "maxtimes_values": _masked(_maxtimes_values)}
_COMPILED: dict = {}
_COMPILED_KEYS: set = set()  # (name, dtype, device type) that ran compiled


def _compiled(name):
    if name not in _COMPILED:
        fn = _WHOLE.get(name, _EAGER.get(name))
        _COMPILED[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _COMPILED[name]


#: programs one kernel may be compiled into (dims of size 1 are specialized, so each
#: mix of them is one; beyond this, sizes not compiled for run eagerly)
RECOMPILES = 32


def _recompiles():
    """torch's recompile limit set to :data:`RECOMPILES` (where this torch has one)."""
    import torch._dynamo

    config = torch._dynamo.config
    if not hasattr(config, "recompile_limit"):
        return contextlib.nullcontext()
    return config.patch(recompile_limit=RECOMPILES)


def try_compiled(key, work: int, device, call):
    """``call()`` (a compiled kernel) where the policy says to compile; None where it
    says not to, or where compiling fails (the caller runs the same formulas eagerly)."""
    if not _should_compile(key, work, device):
        return None
    try:
        with warnings.catch_warnings():  # torch's own deprecations, raised while compiling
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch")
            with _recompiles():
                out = call()
        _COMPILED_KEYS.add(key)
        return out
    except Exception as e:  # no compiler, unsupported device: same formulas, eagerly
        if is_out_of_memory(e):  # not the compiler's fault: keep it for the next call
            raise
        if type(e).__name__ == "FailOnRecompileLimitHit":  # this call's sizes alone
            log.info("compiled %s kernel: too many size variants; these run eagerly", key[0])
            return None
        _state["failed"].add(key)
        log.warning("compiled %s kernel unavailable (%s); using the eager one", key[0], e)
        return None


def _run(name, a, wt, prep=None):
    """Run kernel ``name`` on batched (B, n, m) fields and (B, p, m) transposed weights;
    ``prep(*a)``: the fields as the eager kernel takes them (the compiled program makes
    them itself, see :data:`_WHOLE`)."""
    n, m, p = a[0].shape[-2], a[0].shape[-1], wt.shape[-2]
    work = a[0].shape[0] * n * m * p
    key = (name, a[0].dtype, a[0].device.type)
    # contiguous inputs: one compiled graph for every shape (no stride guards)
    out = try_compiled(
        key,
        work if has_storage(a[0]) and has_storage(wt) else 0,  # (batched: eagerly)
        a[0].device,
        lambda: _compiled(name)(*(plain(f) for f in a), plain(wt)),
    )
    if out is not None:
        return out
    if prep is not None:
        a = prep(*a)
    step = chunk_rows(n, 4 * m * p * a[0].shape[0])
    outs = [_EAGER[name](*(f[:, r : r + step] for f in a), wt) for r in range(0, n, step)]
    return tuple(torch.cat(parts, 1) for parts in zip(*outs))


def _flat(fields, wt):
    batch = torch.broadcast_shapes(fields[0].shape[:-2], wt.shape[:-2])
    b = math.prod(batch)  # not -1: a batch of 0 rows is no error
    fields = [f.expand(*batch, *f.shape[-2:]).reshape(b, *f.shape[-2:]) for f in fields]
    wt = wt.expand(*batch, *wt.shape[-2:]).reshape(b, *wt.shape[-2:])
    return batch, fields, wt


def maxtimes(hi, lo, wt, argmax: bool = True):
    """``out_hi[..., i, k] = max_j hi|lo[..., i, j] * w[..., j, k]`` (hi where w >= 0, lo
    where w < 0), ``out_lo`` likewise with min; with the first argmax / argmin ``j``
    (``(out_hi, j_hi, out_lo, j_lo)``), or without them (``(out_hi, out_lo)``).

    The weights come transposed, ``wt[..., k, j] = w[..., j, k]`` (the reduced dim
    contiguous), or packed for the native kernel (:class:`.native.Packed`, from
    ``MaxProduct.prepare``). ``(hi, lo) = (-inf, +inf)`` is "no path": it never wins,
    even against a zero weight.
    """
    from . import native  # the blocked kernel where it is built and fits, else torch's

    if isinstance(wt, native.Packed):
        outs = native.maxtimes_packed(hi, lo, wt, argmax)
        if outs is not None:
            return outs
        wt = wt.unpack()  # values the native kernel does not take: torch's read them
    batch, (hi, lo), wt = _flat((hi, lo), wt)
    outs = native.maxtimes(hi, lo, wt, argmax)
    if outs is None:
        outs = _run("maxtimes" if argmax else "maxtimes_values", (hi, lo), wt, prep=zero_masked)
    return tuple(o.reshape(*batch, *o.shape[-2:]) for o in outs)


def maxplus(m, lwt):
    """``out[..., i, k] = max_j m[..., i, j] + lw[..., j, k]`` and its first argmax ``j``,
    for the transposed ``lwt[..., k, j] = lw[..., j, k]``. A NaN among the sums (no
    argmax exists) is a :class:`NonFiniteError`."""
    batch, (m,), lwt = _flat((m,), lwt)
    outs = _run("maxplus", (m,), lwt)
    # only where a max is NaN, which needs a non-finite forward value; on a device this
    # would wait for it, and the forward's own check reports that value at the end
    if m.device.type == "cpu" and outs[1].numel() and int(outs[1].max()) >= m.shape[-1]:
        raise NonFiniteError(
            "NaN reached a max-plus contraction in the reverse pass (a forward value read "
            "as an edge weight is NaN): check the inputs and the model's weights"
        )
    return tuple(o.reshape(*batch, *o.shape[-2:]) for o in outs)


#: max-plus top-k: inner sizes are padded to a multiple of this (``PAD``) and cut in
#: blocks of ``_block(m)``; below ``BLOCKED_MIN`` the sums of a (row, column) are ranked
#: whole
PAD, BLOCKED_MIN = 64, 256


def _block(m: int) -> int:
    return 64 if m >= 2048 else 16  # measured on a 2-core CPU, BERT's shapes


def _block_max(m, lwt, bs: int):
    """(B, n, m) x (B, p, m) -> (B, n, p, m // bs): max of m + lw over each block of bs."""
    c = m[:, :, None, :] + lwt[:, None, :, :]
    return c.view(*c.shape[:-1], c.shape[-1] // bs, bs).amax(-1)


def _block_candidates(m, lwt, blocks, bs: int):
    """m + lw at every element of the chosen blocks (B, n, p, kb), and their indices."""
    b, n, p, _ = blocks.shape
    idx = (blocks[..., None] * bs + torch.arange(bs, device=m.device)).flatten(-2)
    bi = torch.arange(b, device=m.device)[:, None, None, None]
    ri = torch.arange(n, device=m.device)[None, :, None, None]
    ji = torch.arange(p, device=m.device)[None, None, :, None]
    return m[bi, ri, idx] + lwt[bi, ji, idx], idx


def _distinct_top(x, k: int, extra: bool):
    """Along the last dim: the k largest distinct values, descending (and the next one
    with ``extra``; -inf past the distinct values there are), the first index of each of
    the k, and whether each of them occurs once and none is NaN: then they are the k
    largest, each at its one index, however ties further down are broken. ``k`` (or
    ``k + 1``) max reductions, each below the last, then one loop for the rest; no sort."""
    ds = [x.amax(-1, keepdim=True)]
    for _ in range(k - 1 + extra):
        ds.append(torch.where(x < ds[-1], x, -INF).amax(-1, keepdim=True))
    once = ((x >= ds[k - 1]).sum(-1) == k) & ~ds[0][..., 0].isnan()
    idx = torch.stack([_first(x == d) for d in ds[:k]], -1)
    return torch.cat(ds, -1), idx, once


def _topk_rows(m, lwt, k: int):
    """(B, n, L) x (B, p, L) -> the k largest of m + lw per (row, column), their
    indices, and where no tie decides them (:func:`_distinct_top`)."""
    return _distinct_top(m[:, :, None, :] + lwt[:, None, :, :], k, False)


def _block_pick(maxima, k: int):
    """The k blocks of best maxima (their first indices, in range), the best maximum
    of the blocks left out, and whether no tie decides which k."""
    ds, blocks, once = _distinct_top(maxima, k, True)
    return blocks.clamp(max=maxima.shape[-1] - 1), ds[..., k], once


def _candidates_top(cand, idx, k: int, rest, picked):
    """The k best candidates, their indices, and where they are decided: no tie among
    them and the k-th above every block left out (``rest``)."""
    ds, j, once = _distinct_top(cand, k, False)
    return ds, idx.gather(-1, j.clamp(max=idx.shape[-1] - 1)), once & picked & (ds[..., -1] > rest)


_EAGER.update(block_max=_block_max, block_candidates=_block_candidates,
              block_pick=_block_pick, candidates_top=_candidates_top,
              topk_rows=_topk_rows)  # fmt: skip


def _topk_blocked(m, lwt, k: int):
    """The k best of each (row, column) from the k blocks with the best maxima (every
    value above a block's max is in a block whose max is higher: the k best values are
    in those blocks), and where no tie decides them; four compiled loops, the
    candidates written out between (ranking them where they are made costs more)."""
    bs = _block(m.shape[-1])
    maxima = _compiled("block_max")(m, lwt, bs)
    kb = min(k, maxima.shape[-1])
    blocks, rest, picked = _compiled("block_pick")(maxima, kb)
    cand, idx = _compiled("block_candidates")(m, lwt, blocks, bs)
    return _compiled("candidates_top")(cand, idx, k, rest, picked)


def _blocked_ranked(x, k: int, bs: int):
    """What ``_topk_blocked`` gave before its rounds, for sums ``x`` (R, L): the k blocks
    by ``topk`` of their maxima, then ``topk`` of their elements (ties as topk breaks
    them, block by block)."""
    maxima = x.view(x.shape[0], -1, bs).amax(-1)
    _, blocks = maxima.topk(min(k, maxima.shape[-1]), -1)
    idx = (blocks[..., None] * bs + torch.arange(bs, device=x.device)).flatten(-2)
    best, j = x.gather(-1, idx).topk(k, -1)
    return best, idx.gather(-1, j)


def _whole_ranked(x, k: int):
    return x.topk(k, -1)


def _undecided_again(best, idx, ok, m, lwt, rank):
    """Where a tie (or a NaN) decides the k best, ``rank`` them as before, from their sums
    (the same bits, tie-breaks included: ``topk`` ranks each row by its own values).
    Where no sum is finite (a row of ``m`` without a path: most rows of D past the
    explained positions), every such output ranks the same row of -inf sums: it is
    ranked once and copied."""
    dead = (best[..., 0] == -INF) & ~ok
    if dead.any():
        row = torch.full((1, m.shape[-1]), -INF, dtype=m.dtype, device=m.device)
        v, ix = rank(row)
        best[dead], idx[dead] = v[0], ix[0]
        ok = ok | dead
    bad = (~ok).nonzero()
    step = chunk_rows(len(bad), 2 * m.shape[-1])
    for r in range(0, len(bad), step):
        b, i, j = bad[r : r + step].unbind(-1)
        v, ix = rank(m[b, i] + lwt[b, j])
        best[b, i, j] = v
        idx[b, i, j] = ix
    return best, idx


def maxplus_topk(m, lwt, k: int):
    """The ``k`` largest of ``m[..., i, j] + lw[..., j, l]`` over ``j``, descending, and
    their ``j`` (``(values, indices)``, each ``(..., i, l, k)``), for the transposed
    ``lwt[..., l, j] = lw[..., j, l]``; ``k`` at most the size of ``j``. Where fewer
    than ``k`` sums are finite, the rest are -inf with indices that mean nothing (past
    ``j``'s size, where ``lwt`` is padded with -inf beyond ``m``'s size).

    Native (:func:`.native.maxplus_kbest`, on a CPU where it is built: k up to 8, no
    NaN or +inf): the k best kept per output as it goes, then, where a tie or too few
    finite sums leave them undecided, those ranked again by eager ``topk`` (so the
    answer is the eager one, ties included). Else compiled (:func:`set_compile`):
    ``k + 1`` max reductions per (row, column) instead
    of a sort (at ``BLOCKED_MIN`` inner elements or more, over the best blocks first,
    then the best of their elements: BERT's (20, 2048) x (2048, 512), k = 3: 8 ms,
    against 37 ms for one ``topk`` over the broadcast); where a tie or a NaN decides the
    k best, those (row, column)s are ranked again by ``topk`` as before, so the
    indices are the same whatever the ties. Eagerly: that ``topk``, in row chunks.
    """
    pad = lwt.shape[-1] - m.shape[-1]
    if pad:
        m = torch.nn.functional.pad(m, (0, pad), value=-INF)
    batch, (m,), lwt = _flat((m,), lwt)
    b, n, inner, p = m.shape[0], m.shape[-2], m.shape[-1], lwt.shape[-2]
    from . import native  # the k-best kernel where it is built and fits

    out = native.maxplus_kbest(m, lwt, k)
    if out is not None:  # (undecided ones ranked as the eager kernel ranks them)
        out = _undecided_again(*out, m, lwt, lambda x: _whole_ranked(x, k))
        return tuple(o.reshape(*batch, n, p, k) for o in out)
    blocked = inner >= BLOCKED_MIN and inner % PAD == 0
    # two keys: the whole rows' kernel gives the eager bits, ties included, so that its
    # compiling (or failing to) never changes when the blocked one compiles
    key = ("maxplus_topk" if blocked else "maxplus_topk_rows", m.dtype, m.device.type)
    out = try_compiled(
        key,
        b * n * inner * p if has_storage(m) and has_storage(lwt) and k <= _ROUNDS_MAX else 0,
        m.device,
        lambda: (_topk_blocked if blocked else _compiled("topk_rows"))(
            m.contiguous(), lwt.contiguous(), k
        ),
    )
    if out is not None:
        bs = _block(inner)
        rank = (lambda x: _blocked_ranked(x, k, bs)) if blocked else (lambda x: _whole_ranked(x, k))
        out = _undecided_again(*out, m, lwt, rank)
        return tuple(o.reshape(*batch, n, p, k) for o in out)
    step = chunk_rows(n, 2 * inner * p * b)
    outs = [
        (m[:, r : r + step, None, :] + lwt[:, None, :, :]).topk(k, -1) for r in range(0, n, step)
    ]
    return tuple(torch.cat(parts, 1).reshape(*batch, n, p, k) for parts in zip(*outs))


#: above this k, max-plus top-k runs eagerly (the compiled kernels unroll k + 1 rounds)
_ROUNDS_MAX = 8
