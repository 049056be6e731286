"""Reading a pass back, for the path readers of :mod:`.paths`: the edge weights of one
op recomputed by its own rule (``_Edges``), MaxProduct's back-pointers found again
(``_Pointers``: the pass keeps hi and lo only), the stored values and the tolerance a
path's product is held to, and the error raised where they do not hold together."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ..engine.reverse import contributions, make_op, slot_values
from ..errors import PathMismatchError
from ..semirings import Real
from ..semirings.base import stack
from ..semirings.maxproduct import unpack_pointer

_REAL = Real()


def _unravel(flat: int, shape) -> tuple[int, ...]:
    out = []
    for s in reversed(tuple(shape)):
        out.append(flat % s)
        flat //= s
    return tuple(reversed(out))


# -- edge weights ---------------------------------------------------------------------


class _Edges:
    """Per-slot partial derivatives of one output element of an op, by the op's own rule."""

    def __init__(self, res):
        self.res = res
        self.needed = res.needed
        self.ops: dict = {}

    def weights(self, consumer_id: int, out_flat: int, inp) -> list[tuple[int, float]]:
        """[(slot, weight)] of the edges ``inp[e] -> consumer[out_flat]`` for every e."""
        graph, values = self.res.graph, self.res.values
        node = graph.nodes[consumer_id]
        if node not in self.ops:
            self.ops[node] = make_op(node, values, self.needed)
        out = values[node]
        seed = torch.zeros(out.numel(), dtype=_float(out).dtype, device=out.device)
        seed[out_flat] = 1
        with torch.no_grad():
            slots = slot_values(
                graph,
                values,
                _REAL,
                consumer_id,
                (seed.view(out.shape),),
                self.needed,
                self.ops[node],
            )
        return [(s, c[0].reshape(-1)) for s, (n, c) in enumerate(slots) if n is inp]


class _Pointers:
    """Back-pointers of a MaxProduct pass, found again: the pass keeps hi and lo only.

    The winning consumer of an element is found by replaying the ⊕ of the pass over the
    consumers' contributions (their rules, run again on their stored values); the
    element of the winner's output, by running its rule with pointer fields
    (``MaxProduct.pointed``), which gives the same values and names the element. Both
    are kept for the last ``MEMO`` node only: a step reads them once or twice, and
    keeping more held pointer tensors as large as an LM head's logits for no speed
    (5 paths on BERT-20: 0.97 s keeping 1 or 2; the pass and one path peak at 49.6 MB
    keeping 1, 54.5 MB keeping 2)."""

    MEMO = 1

    def __init__(self, res, k, sr):
        self.res, self.k, self.sr = res, k, sr
        memo = res.__dict__.setdefault("_pointers", {})
        self.winners = memo.setdefault(("winners", k), _Recent(self.MEMO))
        self.full = memo.setdefault(("full", k), _Recent(self.MEMO))

    def consumer(self, node, e: int, f: int) -> int:
        """The id of the consumer op that won element ``e`` of ``node``'s ⊕ (field ``f``:
        0 hi, 1 lo); -1 where no consumer has a path. The replayed ⊕ must give the value
        the pass stored there: a pointer found from other values would lead elsewhere.

        A node with one consumer (most are) needs no replay at neuron granularity: the
        consumer's rule run with pointer fields (what :meth:`element` reads next) gives
        the same values, checked here the same way."""
        res = self.res
        reached = [c for c in node.users if c in res._store] if self.sr.neuron else ()
        if len(reached) == 1:
            winner = res.graph.ids[reached[0]]
            replayed = self._full(winner, node)
        else:
            replayed, winner = self._replayed(node), None
        stored = self.sr._normalize(_raw(res, node, self.k))
        got, want = float(replayed[f].reshape(-1)[e]), float(stored[f].reshape(-1)[e])
        if not (got == want or math.isclose(got, want, rel_tol=_tol(self.res), abs_tol=1e-300)):
            where = _unravel(e, self.res.values[node].shape)
            raise PathMismatchError(
                f"{self.sr.name} path reading: at node `{node.name}` element {where} the "
                f"consumers' values ⊕ to {('hi', 'lo')[f]} = {got!r}, but the pass stored "
                f"{want!r}. {_STALE}"
            )
        return winner if winner is not None else int(replayed[2 + f].reshape(-1)[e])

    def consumers(self, node) -> tuple:
        """The winning consumer ids of every element of ``node`` (hi, lo; -1: none)."""
        replayed = self._replayed(node)
        return replayed[2], replayed[3]

    def _replayed(self, node):
        if node not in self.winners:
            self.winners[node] = self._replay(node)
        return self.winners[node]

    def _replay(self, node):
        res, sr, graph = self.res, self.sr, self.res.graph
        ids = graph.ids
        acc = None
        # the pass visits consumers from the last one back, and ⊕ keeps its running sum
        # on ties: the same order, the same ⊕ (pointer fields carried along)
        for c in sorted(node.users, key=ids.__getitem__, reverse=True):
            d = res._store.get(c)
            if d is None:
                continue
            with torch.no_grad():
                for inp, _, v in contributions(
                    graph, res.values, [sr], ids[c], [d[self.k]], res.needed
                ):
                    if inp is node:
                        stamp = torch.full_like(v[0], ids[c], dtype=torch.long)
                        v = type(v)((v[0], v[1], stamp, stamp))
                        acc = v if acc is None else sr.pointed.plus(acc, v)
        if acc is None:
            raise _broken(node)
        return sr.pointed._normalize(acc)

    def element(self, c_id: int, node, e: int, f: int) -> int:
        """The element of consumer ``c_id``'s output that element ``e`` of ``node``
        takes its ``f`` field from (neuron granularity)."""
        p_id, p_idx = unpack_pointer(int(self._full(c_id, node)[2 + f].reshape(-1)[e]))
        if p_id != c_id:
            raise _broken(node)
        return p_idx

    def _full(self, c_id: int, node):
        """Consumer ``c_id``'s rule for ``node``, run with pointer fields: hi, lo and,
        per element, the element of ``c_id``'s output each comes from."""
        res, sr = self.res, self.sr.pointed
        if (c_id, node) not in self.full:
            c = res.graph.nodes[c_id]
            with torch.no_grad():
                slots = slot_values(
                    res.graph, res.values, sr, c_id, _raw(res, c, self.k), res.needed
                )
                cs = [v for n, v in slots if n is node]
                if not cs:
                    raise _broken(node)
                self.full[c_id, node] = cs[0] if len(cs) == 1 else sr.sum(stack(cs), 0)
        return self.full[c_id, node]


class _Recent(OrderedDict):
    """A dict of the ``size`` entries set or read last."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def __getitem__(self, key):
        self.move_to_end(key)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        while len(self) > self.size:
            self.popitem(last=False)


def _float(t):
    return t if t.is_floating_point() else t.double()


def _raw(res, node, k):
    return res._store[node][k]


def _tol(res) -> float:
    """Relative tolerance between a path's recomputed product and the semiring's value:
    set by the least precise float dtype in the pass (a float64 Llama still runs its
    RMSNorm in float32)."""
    if not hasattr(res, "_path_tol"):
        vals = (n.meta.get("val") for n in res.graph.nodes)  # from the trace: no values read
        eps = max(
            (torch.finfo(v.dtype).eps for v in vals
             if isinstance(v, torch.Tensor) and v.is_floating_point()),
            default=torch.finfo(torch.float64).eps,
        )  # fmt: skip
        res._path_tol = min(0.05, 1e4 * eps)
    return res._path_tol


_STALE = (
    "The result does not hold together: its values or the model's forward values were "
    "changed after the pass (or this is a bug: please report it with the model). Run "
    "backprop again; no path was returned."
)


def _broken(node):
    return PathMismatchError(
        f"path reading: the back-pointer chain breaks at node `{node.name}` (no consumer "
        f"carries the path on to the output). {_STALE}"
    )
