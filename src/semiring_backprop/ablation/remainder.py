"""The patched forward of :class:`.patching.Patching` from the patched nodes on: only the
ops that read a patched value, directly or not, run again; every other value is the
clean run's (it is what the whole forward would compute again, the same op on the same
inputs). Values are freed after their last read, so that a batch of variants (along a
new leading dimension, ``torch.vmap``) holds only what is still to be read.

Examples::

    rest = p.remainder([site])                  # p: a Patching
    m = rest(p.base, {site: lambda v: 0 * v})   # the output with the site zeroed
"""

from __future__ import annotations

from .patching_edges import args_of, call

__all__ = ["Remainder"]


class Remainder:
    """The ops of ``order`` (a forward's ops, in graph order) that read one of ``starts``
    (the patched nodes, themselves included), with what each may drop once it ran."""

    def __init__(self, order, starts, out):
        starts = set(starts)
        changed: set = set()
        self.order = []
        for n in order:
            if n in starts or any(a in changed for a in n.all_input_nodes):
                changed.add(n)
                self.order.append(n)
        self.out = out
        #: whether an op reads a value this run changes (else it keeps its clean value)
        self.fresh = [any(a in changed for a in n.all_input_nodes) for n in self.order]
        last = {}
        for i, n in enumerate(self.order):
            for a in n.all_input_nodes:
                if a in changed:
                    last[a] = i
        self.drop: list[list] = [[] for _ in self.order]
        for a, i in last.items():
            if a is not out:
                self.drop[i].append(a)

    @property
    def reaches(self) -> bool:
        """Whether the output reads a patched node at all (else it is the clean one)."""
        return bool(self.order) and self.order[-1] is self.out

    def __call__(self, base: dict, replace: dict):
        """The output with each node of ``replace`` (``{node: function of its value}``)
        replaced, every value not downstream of one read from ``base``."""
        if not self.reaches:
            return base[self.out]
        local: dict = {}
        for node, fresh, drop in zip(self.order, self.fresh, self.drop):
            out = call(node, *args_of(node, local, base)) if fresh else base[node]
            if node in replace:
                out = replace[node](out)
            local[node] = out
            for n in drop:
                del local[n]
        return local[self.out]
