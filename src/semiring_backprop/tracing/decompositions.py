"""How composite ops are broken into primitives before the pass (DESIGN §1).

Everything goes to core ATen through torch's own decompositions, except these
composites, which we decompose ourselves so that (a) the softmax stability shift is
the edge-free ``softmax_shift`` op and (b) the primitives are the paper's: softmax as
exp / sum / div, layer norm as mean / sub / pow / rsqrt / mul, GELU through erf or tanh,
SDPA as matmul / softmax / matmul; batch norm in eval mode as an affine map of
constants, group and instance norm as layer norm is. Any of the first four can be kept
whole by name.
"""

from __future__ import annotations

import math

import torch

from ..errors import InputError
from . import ops as _ops  # noqa: F401

aten = torch.ops.aten
shift = torch.ops.semiring_backprop.softmax_shift

KEEPABLE = ("softmax", "log_softmax", "layer_norm", "gelu")


def _dims(x, dim):
    dims = [dim] if isinstance(dim, int) else list(dim)
    return [d % max(x.dim(), 1) for d in dims]


def softmax(x, dim, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    e = torch.exp(x - shift(x, _dims(x, dim)))
    return e / e.sum(dim, keepdim=True)


def safe_softmax(x, dim, dtype=None):
    """torch's safe softmax: a row that may attend to nothing (all -inf) gets zeros and
    no edges, not NaN."""
    if dtype is not None:
        x = x.to(dtype)
    dead = torch.isneginf(x).all(dim, keepdim=True)
    return softmax(x.masked_fill(dead, 0.0), dim).masked_fill(dead, 0.0)


def _softmax(x, dim, half_to_float=False):
    return softmax(x, dim)


def log_softmax(x, dim, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    z = x - shift(x, _dims(x, dim))
    return z - torch.log(torch.exp(z).sum(dim, keepdim=True))


def _log_softmax(x, dim, half_to_float=False):
    return log_softmax(x, dim)


def logsumexp(x, dim, keepdim=False):
    dims = _dims(x, dim)
    s = shift(x, dims)
    out = torch.log(torch.exp(x - s).sum(dims, keepdim=True)) + s
    return out if keepdim else out.squeeze(dims)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    d = x - x.mean(dims, keepdim=True)
    y = d * torch.rsqrt(d.pow(2).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _normalize(x, dims, eps):
    """``(x - mean) / sqrt(var + eps)`` over ``dims``, by the same primitives as layer norm."""
    d = x - x.mean(dims, keepdim=True)
    var = d.pow(2).mean(dims, keepdim=True)
    return d * torch.rsqrt(var + eps), var


def _per_channel(t, x):
    """A per-channel vector (dim 1 of ``x``) shaped to broadcast against ``x``."""
    return t.reshape(-1, *[1] * (x.dim() - 2)) if x.dim() > 1 else t


def _affine(y, x, weight, bias):
    if weight is not None:
        y = y * _per_channel(weight, x)
    if bias is not None:
        y = y + _per_channel(bias, x)
    return y


def batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    """Batch norm in eval mode: the running statistics are constants of the model."""
    y = (x - _per_channel(running_mean, x)) * _per_channel(torch.rsqrt(running_var + eps), x)
    return _affine(y, x, weight, bias), x.new_zeros((0,)), x.new_zeros((0,))


def batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    """Normalized by the batch's own statistics (instance norm, and batch norm without
    running statistics): per channel, over every other dim."""
    dims = [d for d in range(x.dim()) if d != 1]
    y, var = _normalize(x, dims, eps)
    mean = x.mean(dims)
    return _affine(y, x, weight, bias), mean, torch.rsqrt(var.reshape(-1) + eps)


def group_norm(x, weight, bias, n, c, hxw, group, eps):
    grouped = x.reshape(n, group, -1)
    y, var = _normalize(grouped, [2], eps)
    mean = grouped.mean(2)
    y = _affine(y.reshape(x.shape), x, weight, bias)
    return y, mean, torch.rsqrt(var.reshape(n, group) + eps)


def rms_norm(x, normalized_shape, weight=None, eps=None):
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return y * weight if weight is not None else y


def gelu(x, approximate="none"):
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))
        return 0.5 * x * (1 + torch.tanh(inner))
    return 0.5 * x * (1 + torch.erf(x * (1 / math.sqrt(2))))


def scaled_dot_product_attention(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if dropout_p > 0:
        raise ValueError(
            f"scaled_dot_product_attention with dropout_p={dropout_p}: call model.eval()"
        )
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]

        def widen(t):
            return t.unsqueeze(-3).expand(*t.shape[:-2], rep, *t.shape[-2:]).flatten(-4, -3)

        k, v = widen(k), widen(v)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    blocked = None  # the pairs the masks keep apart (read from the masks alone)
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        blocked = ~keep
        scores = scores.masked_fill(blocked, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
            off = ~attn_mask
        else:
            scores = scores + attn_mask
            off = torch.isneginf(attn_mask)
        blocked = off if blocked is None else blocked | off
    if blocked is None:
        return torch.matmul(torch.softmax(scores, -1), v)
    # torch's safe softmax: a query that may attend to nothing (left padding) gets zeros,
    # not NaN, and no edges; which queries those are is read from the masks (the scores
    # are finite), so that their zeros are structural (engine.structure)
    dead = blocked.all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    return torch.matmul(probs, v)


def native_dropout(x, p, train):
    """Dropout as it runs in training mode (``allow_training=True``): a random mask."""
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if p >= 1:
        return x * 0.0, torch.zeros_like(x, dtype=torch.bool)
    keep = torch.rand_like(x) >= p
    return x * keep * (1.0 / (1.0 - p)), keep


def var_correction(x, dim=None, *, correction=None, keepdim=False):
    dims = list(range(x.dim())) if dim is None else _dims(x, dim)
    n = math.prod(x.shape[d] for d in dims)
    c = 1 if correction is None else correction
    d = x - x.mean(dims, keepdim=True)
    return d.pow(2).sum(dims, keepdim=keepdim) / max(n - c, 0)


def var_mean_correction(x, dim=None, *, correction=None, keepdim=False):
    dims = list(range(x.dim())) if dim is None else _dims(x, dim)
    return var_correction(x, dims, correction=correction, keepdim=keepdim), x.mean(
        dims, keepdim=keepdim
    )


def _extreme(reduce_idx):
    def fn(x, dim, keepdim=False):
        idx = reduce_idx(x, dim, keepdim=True)
        vals = torch.gather(x, dim, idx)
        if not keepdim:
            vals, idx = vals.squeeze(dim), idx.squeeze(dim)
        return vals, idx

    return fn


def masked_scatter(x, mask, source):
    """Where ``mask`` holds, the next element of ``source`` in order; elsewhere ``x``
    (how vision-language models put image features in place of image tokens): a
    selection, with edges from each output to the one element it takes."""
    flat = mask.expand_as(x).reshape(-1)
    taken = torch.cumsum(flat.to(torch.int64), 0) - 1  # which source element, in order
    picked = source.reshape(-1)[taken.clamp(min=0)]
    return torch.where(flat, picked, x.reshape(-1)).reshape(x.shape)


def split(x, split_size, dim=0):
    n = x.shape[dim]
    sizes = [min(split_size, n - s) for s in range(0, n, split_size)] if n else [0]
    return split_with_sizes(x, sizes, dim)


def split_with_sizes(x, sizes, dim=0):
    out, start = [], 0
    for s in sizes:
        out.append(aten.slice(x, dim, start, start + s))
        start += s
    return out


def unbind(x, dim=0):
    return [aten.select(x, dim, i) for i in range(x.shape[dim])]


_OURS = {
    "softmax": {aten.softmax.int: softmax, aten._softmax.default: _softmax},
    "log_softmax": {aten.log_softmax.int: log_softmax, aten._log_softmax.default: _log_softmax},
    "layer_norm": {aten.layer_norm.default: layer_norm},
    "gelu": {aten.gelu.default: gelu},
    None: {
        aten.logsumexp.default: logsumexp,
        aten._safe_softmax.default: safe_softmax,
        aten.rms_norm.default: rms_norm,
        aten._native_batch_norm_legit_no_training.default: batch_norm_no_training,
        aten._native_batch_norm_legit.no_stats: batch_norm_no_stats,
        aten.native_group_norm.default: group_norm,
        aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
        aten.native_dropout.default: native_dropout,
        aten.var.correction: var_correction,
        aten.var_mean.correction: var_mean_correction,
        aten.max.dim: _extreme(lambda x, d, keepdim: x.argmax(d, keepdim=keepdim)),
        aten.min.dim: _extreme(lambda x, d, keepdim: x.argmin(d, keepdim=keepdim)),
        aten.masked_scatter.default: masked_scatter,
        aten.split.Tensor: split,
        aten.split_with_sizes.default: split_with_sizes,
        aten.unbind.int: unbind,
    },
}

# resampling ops that core ATen keeps whole: torch's own decompositions (index arithmetic
# and a weighted sum of the gathered neighbours) give them edges
_RESAMPLING = (
    aten.upsample_nearest1d.vec, aten.upsample_nearest1d.default,
    aten.upsample_nearest2d.vec, aten.upsample_nearest2d.default,
    aten.upsample_nearest3d.vec, aten.upsample_nearest3d.default,
    aten._upsample_nearest_exact1d.vec, aten._upsample_nearest_exact1d.default,
    aten._upsample_nearest_exact2d.vec, aten._upsample_nearest_exact2d.default,
    aten._upsample_nearest_exact3d.vec, aten._upsample_nearest_exact3d.default,
    aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default,
    aten.upsample_trilinear3d.vec, aten.upsample_trilinear3d.default,
)  # fmt: skip

# ops torch's table lowers to something with other edges: detach becomes alias (a
# weight-1 routing op), which would let paths through what autograd stops
_NEVER_DECOMPOSE = (aten.detach.default,)


# -- paper mode: the graph as the paper's library (brunoflow) builds it ----------------
#
# brunoflow differs from the decompositions above in four ways, each of which changes
# tensor-granularity values (DESIGN §1, paper mode): its layer norm computes
# var = E[x²] - E[x]²; its GELU is one pointwise op; its softmax is exp(log_softmax)
# with a logsumexp whose max carries an edge to the row's (first) argmax; and every
# selection (indexing, the max's backward) is dense: the elements it does not select
# receive 0 (a path of weight 0), not "no path". Here a selection is a product with a
# one-hot mask summed over the selected dim, which gives exactly that.


def _one_hot(n, index, dim, ndim, like):
    """``1.0`` where the position along ``dim`` equals ``index`` (broadcastable), else 0."""
    shape = [1] * ndim
    shape[dim] = n
    positions = torch.arange(n, device=like.device).view(shape)
    return (positions == index).to(like.dtype)


def _paper_max(x, dim):
    """The max along ``dim`` (kept): brunoflow's ``reduce_max``, an edge of weight 1 to
    the first argmax and of weight 0 to every other element of the row."""
    idx = x.argmax(dim, keepdim=True)
    # masked (-inf) scores, which have no edges, kept finite: 0 · -inf would be NaN
    finite = x.clamp(min=torch.finfo(x.dtype).min)
    return (finite * _one_hot(x.shape[dim], idx, dim, x.dim(), x)).sum(dim, keepdim=True)


def _paper_logsumexp(x, dim):
    m = _paper_max(x, dim)
    return torch.log(torch.exp(x - m).sum(dim, keepdim=True)) + m


def paper_log_softmax(x, dim, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    return x - _paper_logsumexp(x, _dims(x, dim)[0])


def paper_softmax(x, dim, dtype=None):
    return torch.exp(paper_log_softmax(x, dim, dtype))


def _paper_softmax(x, dim, half_to_float=False):
    return paper_softmax(x, dim)


def _paper_log_softmax(x, dim, half_to_float=False):
    return paper_log_softmax(x, dim)


def paper_logsumexp(x, dim, keepdim=False):
    dims = _dims(x, dim)
    if len(dims) != 1:
        return logsumexp(x, dims, keepdim)
    out = _paper_logsumexp(x, dims[0])
    return out if keepdim else out.squeeze(dims)


def paper_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """brunoflow's ``LayerNorm``: ``(x - E[x]) / sqrt(E[x²] - E[x]² + eps)``, means as
    sums divided by n, then ``weight * x_norm + bias``."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    n = math.prod(x.shape[d] for d in dims)
    mean = x.sum(dims, keepdim=True) / n
    var = (x**2).sum(dims, keepdim=True) / n - mean**2
    y = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = weight * y
    if bias is not None:
        y = y + bias
    return y


def paper_select(x, dim, index):
    """``x.select(dim, index)`` as brunoflow's ``getitem``: every element of ``x`` has an
    edge, of weight 1 where selected and 0 elsewhere."""
    if not x.is_floating_point():
        return NotImplemented  # (integer ids, masks: no paths either way)
    dim = dim % x.dim()
    n = x.shape[dim]
    index = index + n if index < 0 else index
    return (x * _one_hot(n, index, dim, x.dim(), x)).sum(dim)


def paper_gather(x, dim, index, sparse_grad=False):
    """``x.gather(dim, index)`` as a dense selection (see :func:`paper_select`), where the
    index has the input's shape but along ``dim``."""
    dim = dim % max(x.dim(), 1)
    same = x.dim() == index.dim() and all(
        a == b for d, (a, b) in enumerate(zip(x.shape, index.shape)) if d != dim
    )
    if not x.is_floating_point() or not same:
        return NotImplemented
    n = x.shape[dim]
    mask = _one_hot(n, index.unsqueeze(dim), dim, x.dim() + 1, x)  # [.., n, k, ..]
    return (x.unsqueeze(dim + 1) * mask).sum(dim)


_PAPER = {
    aten.softmax.int: paper_softmax,
    aten._softmax.default: _paper_softmax,
    aten.log_softmax.int: paper_log_softmax,
    aten._log_softmax.default: _paper_log_softmax,
    aten.logsumexp.default: paper_logsumexp,
    aten.layer_norm.default: paper_layer_norm,
    aten.select.int: paper_select,
    aten.gather.default: paper_gather,
}


def table(whole: tuple[str, ...] = (), paper: bool = False) -> dict:
    """The decomposition table for ``ExportedProgram.run_decompositions`` (``paper``:
    brunoflow's graph, see above; GELU then stays one pointwise op)."""
    unknown = set(whole) - set(KEEPABLE)
    if unknown:
        raise InputError(
            f"whole={sorted(unknown)}: only these composite ops can be kept whole: "
            f"{', '.join(KEEPABLE)}"
        )
    t = torch.export.default_decompositions()
    for name, ops in _OURS.items():
        for op, fn in ops.items():
            if name in whole:
                t.pop(op, None)
            else:
                t[op] = fn
    from torch._decomp import get_decompositions

    t.update(get_decompositions(list(_RESAMPLING)))
    for op in _NEVER_DECOMPOSE:
        t.pop(op, None)
    if paper:
        t.update({op: fn for op, fn in _PAPER.items() if _kept_name(op) not in whole})
        t.pop(aten.gelu.default, None)
    return t


def _kept_name(op) -> str | None:
    return next((name for name, ops in _OURS.items() if name and op in ops), None)
