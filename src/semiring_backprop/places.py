"""A place: how a caller names a node of the traced graph (an input's position or
keyword, a module path, ``"module:input"``, a node's name, or a pattern over module paths
for ``keep=``), and the dimensions of the value found there."""

from __future__ import annotations

import difflib
import fnmatch

import torch

from .errors import InputError, NotFoundError

__all__ = ["check_dims", "find_node", "resolve_keep"]


def _keys(d):
    return ", ".join(repr(k) for k in d) or "none"


def find_node(g, where) -> torch.fx.Node:
    """The graph node for an input position/keyword, a module path or a node name."""
    if isinstance(where, torch.fx.Node):
        return where
    try:
        given = where in g.user_inputs
    except TypeError:  # unhashable: a list or a dict is no place
        raise InputError(
            f"a place is an int (args position), an input name or a module path, got {where!r}"
        ) from None
    if given:
        return g.user_inputs[where]
    if isinstance(where, int):
        raise NotFoundError(
            f"args[{where}] is not a tensor input of the traced call "
            f"(tensor inputs: {_keys(g.user_inputs)})"
        )
    if not isinstance(where, str):
        raise InputError(f"at() takes an int, an input name or a module path, got {where!r}")
    if where in g.tags:
        return g.tags[where]
    suffix = [t for t in g.tags if t.endswith("." + where)]
    if len(suffix) == 1:
        return g.tags[suffix[0]]
    if len(suffix) > 1:
        raise NotFoundError(f"{where!r} matches several modules: {suffix[:8]}; give the full path")
    by_name = {n.name: n for n in g.nodes}
    if where in by_name:
        return by_name[where]
    near = difflib.get_close_matches(where, list(g.tags) + list(map(str, g.user_inputs)), n=5)
    hint = f" Did you mean: {', '.join(near)}?" if near else ""
    raise NotFoundError(
        f"no input, module or node named {where!r} in the traced graph.{hint} Module paths "
        "are those of model.named_modules(); add ':input' for a module's first input."
    )


def resolve_keep(g, places) -> frozenset:
    """The nodes named by ``keep=``: places as for :meth:`Result.at`; a string with
    ``*``, ``?`` or ``[`` is matched against every module path (``*.attention:input``)."""
    nodes = set()
    for where in places:
        if isinstance(where, str) and any(c in where for c in "*?["):
            hits = [n for tag, n in g.tags.items() if fnmatch.fnmatchcase(tag, where)]
            if not hits:
                raise NotFoundError(
                    f"keep={where!r} matches no module path (e.g. {next(iter(g.tags), '')!r})"
                )
            nodes.update(hits)
        else:
            nodes.add(find_node(g, where))
    return frozenset(m for n in nodes for m in g.aliases.get(n, (n,)))


def check_dims(dims, node, where) -> tuple[int, ...]:
    """``dims`` as a tuple of valid dimensions of ``node``'s value, or an InputError."""
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
    given = (dims,) if isinstance(dims, int) else dims
    try:
        given = tuple(given)
    except TypeError:
        given = (given,)
    rank = len(shape) if shape is not None else None
    for d in given:
        bad = isinstance(d, bool) or not isinstance(d, int)
        if bad or (rank is not None and not -rank <= d < rank):
            raise InputError(
                f"dims={dims!r}: the value at {where!r} has shape {shape}, so each dim is an "
                f"int from {-rank if rank else 0} to {rank - 1 if rank else 0} (e.g. dims=(-1,) "
                "for the hidden units)"
            )
    if len({d % rank for d in given} if rank else set(given)) < len(given):
        raise InputError(f"dims={dims!r} names a dimension twice; name each once")
    return given
