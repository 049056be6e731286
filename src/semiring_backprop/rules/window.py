"""Sliding-window ops: convolution (a contraction) and average pooling.

Both read, for each output position, a window of input positions. The window
structure is an index map: for every input position ``p`` and kernel offset ``k``, the
output position ``q`` that reads ``p`` through ``k`` (-1 for none). The rule gathers
the output's value along that map (the semiring's zero where there is none) and then
⊕-contracts it with the weights, so that every input element gets exactly its edges:
``x[c, p] -> out[o, q]`` for every ``(o, k)`` with ``q`` the position ``p`` reaches
through ``k``, of weight ``w[o, c, k]`` (dense, whatever the weight's value, as for a
matmul). Transposed convolutions read the same map the other way round. Padding
positions are not elements: they carry no edges.
"""

from __future__ import annotations

import math

import torch

from ..semirings.base import fmap, fmap2
from .registry import reads_nothing, register, register_forward

aten = torch.ops.aten


# -- index maps --------------------------------------------------------------------------


def _strided(n_in, n_out, k, stride, pad, dil, transposed, device):
    """``[n_in, k]``: the output position that input ``p`` reaches through offset ``k``."""
    p = torch.arange(n_in, device=device)[:, None]
    j = torch.arange(k, device=device)[None, :]
    if transposed:  # out[p·s + k·d - pad] += x[p] · w[k]
        q = p * stride + j * dil - pad
        ok = (q >= 0) & (q < n_out)
    else:  # out[q] += x[q·s + k·d - pad] · w[k]
        num = p + pad - j * dil
        q = torch.div(num, stride, rounding_mode="floor")
        ok = (num >= 0) & (num % stride == 0) & (q < n_out)
    return torch.where(ok, q, -1)


def _adaptive(n_in, n_out, device):
    """``[n_in, slots]``: the outputs whose adaptive window (``floor(q·n/m)`` to
    ``ceil((q+1)·n/m)``) holds input ``p``."""
    q = torch.arange(n_out, device=device)
    start = torch.div(q * n_in, n_out, rounding_mode="floor")
    end = torch.div((q + 1) * n_in + n_out - 1, n_out, rounding_mode="floor")
    p = torch.arange(n_in, device=device)[:, None]
    inside = (p >= start) & (p < end)  # [n_in, n_out]
    slots = int(inside.sum(1).max())
    rank = torch.cumsum(inside, 1) - 1  # the slot of each (p, q) inside
    out = torch.full((n_in, slots), -1, dtype=torch.long, device=device)
    pp, qq = inside.nonzero(as_tuple=True)
    out[pp, rank[pp, qq]] = qq
    return out


def _combine(maps, out_sizes):
    """Per-dim maps ``[n_in_i, k_i]`` -> one map ``[prod n_in, prod k]`` of flat output
    positions (row-major over the spatial dims), -1 where any dim has none."""
    n = len(maps)
    flat, valid, step = 0, True, 1
    for i in reversed(range(n)):
        shape = [1] * (2 * n)
        shape[i], shape[n + i] = maps[i].shape
        m = maps[i].reshape(shape)
        flat = flat + m * step
        valid = valid & (m >= 0)
        step *= out_sizes[i]
    flat = torch.where(valid, flat, -1)
    p = math.prod(m.shape[0] for m in maps)
    return flat.reshape(p, -1)


def _gather(sr, g, index, n_lead):
    """``g[..., Q]`` (``n_lead`` leading dims, spatial dims flattened) read along
    ``index`` (``[P, K]``, -1 for none): ``[..., P, K]``, the zero where there is none."""
    lead = g[0].shape[:n_lead]
    rows = math.prod(lead)
    # positions first: index_select of whole rows (a gather along the last dim, or
    # advanced indexing, is 10-50x slower on a CPU)
    q = math.prod(g[0].shape[n_lead:])  # explicit sizes: an empty batch is no error
    flat = fmap(lambda f: f.reshape(rows, q).t(), g)
    pad = sr.zero((1, rows), g[0])
    padded = fmap2(lambda f, z: torch.cat([f, z], 0), tuple(flat), pad)
    idx = torch.where(index >= 0, index, q).reshape(-1)
    return fmap(lambda f: f.index_select(0, idx).t().reshape(*lead, *index.shape), padded)


# -- convolution -------------------------------------------------------------------------


def _conv_map(op, x, w, stride, padding, dilation, transposed):
    def make():
        n = w.dim() - 2
        ins, outs = x.shape[-n:], op.out.shape[-n:]
        # one value for every dimension (padding="valid" is traced as [0])
        st, pad, dil = (_per_dim(v, n) for v in (stride, padding, dilation))
        maps = [
            _strided(ins[i], outs[i], w.shape[2 + i], st[i], pad[i], dil[i], transposed,
                     x.device)
            for i in range(n)
        ]  # fmt: skip
        return _combine(maps, outs)

    return op.cached("map", make)


def _per_dim(value, n: int) -> list:
    value = [value] if isinstance(value, int) else list(value)
    return value * n if len(value) == 1 else value


@register(aten.convolution.default, "contraction")
def _convolution(sr, g, op, x, w, bias, stride, padding, dilation, transposed, out_pad, groups):
    n = w.dim() - 2
    if x.numel() == 0 or op.out.numel() == 0:  # an empty batch: no edges at all
        args = (x, w, bias)
        return [
            sr.zero(t.shape, t) if isinstance(t, torch.Tensor) and op.needs(i) else None
            for i, t in enumerate(args)
        ]
    unbatched = x.dim() == n + 1
    if unbatched:
        x, g = x.unsqueeze(0), fmap(lambda f: f.unsqueeze(0), g)
    batch, c_in, *p_in = x.shape
    c_out = op.out.shape[-n - 1]
    gr = groups
    index = _conv_map(op, x, w, stride, padding, dilation, transposed)  # [P, K]
    npos, nk = index.shape
    taps = _gather(sr, g, index, 2)  # [N, O, P, K]
    dx = dw = db = None
    npos_out = math.prod(op.out.shape[-n:])
    if op.needs(0) and c_in * nk * (npos_out + npos) < c_out * npos * nk:
        # fewer input channels than output ones (an image's first conv, a patch
        # embedding): contract over o first, on the output's grid, then gather
        dx = _conv_dx_by_columns(sr, g, w, index, gr, transposed, (batch, c_in, *p_in))
        if unbatched:
            dx = fmap(lambda f: f.squeeze(0), dx)
    elif op.needs(0):
        # rows (g, n, p), columns (o, k): ⊕_(o, k) taps ⊗ w[o, c, k] -> [g, n·p, c]
        a = fmap(
            lambda f: (
                f.reshape(batch, gr, c_out // gr, npos, nk)
                .permute(1, 0, 3, 2, 4)
                .reshape(gr, batch * npos, (c_out // gr) * nk)
            ),
            taps,
        )
        wm, prep = op.weight(sr, 1, lambda: _weight_matrix(w, gr, transposed))
        d = sr.matmul(a, wm, prep)  # [g, n·p, c/g]
        dx = fmap(
            lambda f: (
                f.reshape(gr, batch, npos, c_in // gr)
                .permute(1, 0, 3, 2)
                .reshape(batch, c_in, *p_in)
            ),
            d,
        )
        if unbatched:
            dx = fmap(lambda f: f.squeeze(0), dx)
    if op.needs(1):
        # batched over (g, k): ⊕_(n, p) taps[n, o, p, k] ⊗ x[n, c, p] -> [g·k, o/g, c/g]
        a = fmap(
            lambda f: (
                f.reshape(batch, gr, c_out // gr, npos, nk)
                .permute(1, 4, 2, 0, 3)
                .reshape(gr * nk, c_out // gr, batch * npos)
            ),
            taps,
        )
        xm = (
            x.reshape(batch, gr, c_in // gr, npos)
            .permute(1, 0, 3, 2)
            .reshape(gr, 1, batch * npos, c_in // gr)
            .expand(gr, nk, batch * npos, c_in // gr)
            .reshape(gr * nk, batch * npos, c_in // gr)
        )
        d = sr.matmul(a, xm)
        # [g, k, o/g, c/g] -> w's layout: (o, c/g, *k) or, transposed, (c, o/g, *k)
        order = (0, 3, 2, 1) if transposed else (0, 2, 3, 1)
        dw = fmap(
            lambda f: f.reshape(gr, nk, c_out // gr, c_in // gr).permute(*order).reshape(w.shape),
            d,
        )
    if isinstance(bias, torch.Tensor) and op.needs(2):
        dims = [d for d in range(g[0].dim()) if d != 1]
        db = sr.sum(g, dims)
    return [dx, dw, db]


def _conv_dx_by_columns(sr, g, w, index, groups, transposed, x_shape):
    """``D(x)``, contracting over the output channels on the output's grid first:
    ``cols[n, c, k, q] = ⊕_o g[n, o, q] ⊗ w[o, c, k]``, then ``D(x)[n, c, p] =
    ⊕_k cols[n, c, k, q(p, k)]``; the same terms as the other order, with temporaries
    of the input's channels (autograd's col2im) instead of the output's."""
    batch, c_in = x_shape[:2]
    npos, nk = index.shape
    c_out = g[0].shape[1]
    o_g, c_g = c_out // groups, c_in // groups
    q = math.prod(g[0].shape[2:])  # explicit sizes throughout: an empty batch is no error
    a = fmap(
        lambda f: (
            f.reshape(batch, groups, o_g, q).permute(1, 0, 3, 2).reshape(groups, batch * q, o_g)
        ),
        g,
    )  # [g, n·q, o/g]
    if transposed:  # w: (c, o/g, *k) -> [g, o/g, (c/g)·k]
        wm = w.reshape(groups, c_g, o_g, nk).permute(0, 2, 1, 3).reshape(groups, o_g, c_g * nk)
    else:  # w: (o, c/g, *k)
        wm = w.reshape(groups, o_g, c_g * nk)
    cols = sr.matmul(a, wm)  # [g, n·q, (c/g)·k]
    cols = fmap(
        lambda f: (
            f.reshape(groups, batch, q, c_g, nk).permute(1, 0, 3, 4, 2).reshape(batch, c_in, nk, q)
        ),
        cols,
    )  # [n, c, k, q]
    # cols[.., k, q] is flat position k·q_count + q of the trailing (k, q)
    flat = torch.where(index >= 0, torch.arange(nk, device=index.device) * q + index, -1)
    taps = _gather(sr, cols, flat, 2)  # [n, c, p, k]
    return fmap(lambda f: f.reshape(x_shape), sr.sum(taps, -1))


def _weight_matrix(w, groups, transposed):
    """``[g, (o/g)·k, c/g]``: row (o, k), column c holds the weight of x[c] -> out[o]."""
    k = math.prod(w.shape[2:])
    if transposed:  # w: (c, o/g, *k)
        c, o_g = w.shape[:2]
        m = w.reshape(groups, c // groups, o_g, k).permute(0, 2, 3, 1)
    else:  # w: (o, c/g, *k)
        o, c_g = w.shape[:2]
        m = w.reshape(groups, o // groups, c_g, k).permute(0, 1, 3, 2)
    return m.reshape(groups, -1, m.shape[-1])


# -- average pooling ---------------------------------------------------------------------


def _pool(sr, g, op, x, n, make_maps, run):
    """``D(x)[.., p] = ⊕_k g[.., q(p, k)] ⊗ lift(1 / divisor(q))`` over the last ``n``
    dims; ``make_maps`` gives the per-dim maps, ``run`` the op on a tensor."""

    def make():
        outs = op.out.shape[-n:]
        index = _combine(make_maps(x.shape[-n:], outs), outs)
        # the weight of q: the op on ones gives (#inputs in q's window) / divisor(q)
        ones = x.new_ones((1, 1, *x.shape[-n:]))
        reach = run(ones).reshape(-1)
        count = torch.bincount(index[index >= 0], minlength=reach.numel()).to(x.dtype)
        weight = torch.where(count > 0, reach / count.clamp_min(1), 0.0)
        return index, torch.where(index >= 0, weight[index], 1.0)

    index, w = op.cached("map", make)
    lead = g[0].dim() - n
    taps = _gather(sr, g, index, lead)  # [..., P, K]
    d = sr.sum(sr.times(taps, w), -1)
    return [fmap(lambda f: f.reshape(x.shape), d)]


def _pool_args(n, kernel, stride, padding):
    kernel = _per_dim(kernel, n)
    stride = _per_dim(stride, n) if stride else kernel
    return kernel, stride, _per_dim(padding, n)


def _avg_pool(n, target):
    def rule(sr, g, op, x, kernel, stride=(), padding=0, *args):
        if not op.needs(0):
            return [None]
        k, s, p = _pool_args(n, kernel, stride, padding)

        def maps(ins, outs):
            return [_strided(ins[i], outs[i], k[i], s[i], p[i], 1, False, x.device)
                    for i in range(n)]  # fmt: skip

        return _pool(sr, g, op, x, n, maps, lambda t: target(t, kernel, stride, padding, *args))

    return rule


def _adaptive_avg_pool(n, target):
    def rule(sr, g, op, x, size):
        if not op.needs(0):
            return [None]

        def maps(ins, outs):
            return [_adaptive(ins[i], outs[i], x.device) for i in range(n)]

        return _pool(sr, g, op, x, n, maps, lambda t: target(t, size))

    return rule


register(aten.avg_pool2d.default, "reduction")(_avg_pool(2, aten.avg_pool2d.default))
register(aten.avg_pool3d.default, "reduction")(_avg_pool(3, aten.avg_pool3d.default))
register(aten._adaptive_avg_pool2d.default, "reduction")(
    _adaptive_avg_pool(2, aten._adaptive_avg_pool2d.default)
)
register(aten._adaptive_avg_pool3d.default, "reduction")(
    _adaptive_avg_pool(3, aten._adaptive_avg_pool3d.default)
)


# -- running sums ------------------------------------------------------------------------


@register(aten.cumsum.default, "reduction", reads=reads_nothing)
def _cumsum(sr, g, op, x, dim, dtype=None):
    """``out[i] = Σ_{j ≤ i} x[j]``: input ``j`` feeds every output from ``j`` on, each
    edge of weight 1, so ``D(x)[j] = ⊕_{i ≥ j} g[i]``; the outputs are gathered per input
    as a pooling window is (a map of ``n × n`` along ``dim``: Mamba2's scans run over
    chunks of a few hundred)."""
    if x.dim() == 0:
        return [g]
    d = dim % x.dim()
    n = x.shape[d]
    if n == 0:
        return [sr.zero(x.shape, x)]

    def make():
        j = torch.arange(n, device=x.device)
        q = j[:, None] + j[None, :]  # input j -> outputs j, j + 1, ..., n - 1
        return torch.where(q < n, q, -1)

    index = op.cached("map", make)
    moved = fmap(lambda f: f.movedim(d, x.dim() - 1), g)  # the scanned dim last
    lead = x.dim() - 1
    out = sr.sum(_gather(sr, moved, index, lead), -1)
    return [fmap(lambda f: f.movedim(x.dim() - 1, d), out)]


@register_forward(aten.cumsum.default)
def _cumsum_forward(sr, a, op, x, dim, dtype=None):
    """``alpha(out)[i] = ⊕_{j ≤ i} a[j]``: the inputs gathered per output."""
    if a[0] is None or x.dim() == 0:
        return a[0]
    d = dim % x.dim()
    n = x.shape[d]
    if n == 0:
        return sr.zero(op.out.shape, op.out)

    def make():
        i = torch.arange(n, device=x.device)
        j = i[:, None] - i[None, :]  # output i <- inputs i, i - 1, ..., 0
        return torch.where(j >= 0, j, -1)

    index = op.cached("map_forward", make)
    moved = fmap(lambda f: f.movedim(d, x.dim() - 1), a[0])
    out = sr.sum(_gather(sr, moved, index, x.dim() - 1), -1)
    return fmap(lambda f: f.movedim(x.dim() - 1, d), out)
