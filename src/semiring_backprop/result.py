"""Result: semiring values per node, looked up by input, module path or node name."""

from __future__ import annotations

import weakref

import torch

from .errors import (
    InputError,
    NonFiniteError,
    PathMismatchError,
    SemiringBackpropError,
)
from .places import check_dims, find_node, resolve_keep
from .semirings.base import Semiring, overflowed

#: (``find_node`` and ``resolve_keep`` live in :mod:`.places`; imported from here too)
__all__ = ["Result", "find_node", "resolve_keep"]


class Result:
    """What one reverse pass computed: every semiring's value at every node, looked up
    by a place: an input (its position in ``args`` or its keyword), a module path (its
    output; ``"module:input"``: its input) or a graph node's name.

    Examples:
        ``res`` explains ``log p(are) - log p(is)`` at the mask of a tiny BERT:

        >>> res
        Result(182 nodes; Real, MaxProduct(neuron), TopK(2), Entropy, PathCount)
        >>> res.at("bert.embeddings.word_embeddings", sbp.Real()).shape  # the gradient
        torch.Size([1, 11, 16])
        >>> ent = res.at("bert.encoder.layer.0.attention:input", sbp.Entropy())
        >>> ent.entropy.shape                      # path entropy at the block's input
        torch.Size([1, 11, 16])
        >>> best = res.aggregate("bert.embeddings.word_embeddings", sbp.MaxProduct())
        >>> tokens[0][best.hi.argmax()]            # the token whose best path is heaviest
        '[MASK]'
    """

    def __init__(self, graph, values: dict, store: dict, semirings: list, kept=None):
        self.graph = graph
        self.values = values
        self.semirings = list(semirings)
        self._store = store
        #: the nodes whose values were kept (``Backprop(keep=...)``); None: all of them
        self.kept = kept

    def __deepcopy__(self, memo):
        """A copy of the values, sharing the traced graph (never changed after tracing;
        torch.export's program holds fake tensors, which cannot be copied)."""
        import copy

        memo[id(self.graph)] = self.graph
        memo.update((id(n), n) for n in self.graph.nodes)  # the values' keys
        new = Result.__new__(Result)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            setattr(new, k, copy.deepcopy(v, memo))
        return new

    def __reduce__(self):
        raise InputError(
            "a Result cannot be pickled: it holds the traced graph (torch.export's program, "
            "with fake tensors and compiled code). Save what you read from it instead: "
            "tensors from res.at(...) with torch.save, tables (res.layer_table(), "
            "res.branches(...)) as DataFrames (to_parquet / to_csv), paths with "
            "path.to_json(file); or keep the Result in memory (copy.deepcopy works)."
        )

    def _require_all(self, what: str):
        if self.kept is not None:
            raise InputError(
                f"{what} reads values at every node, but this pass kept only "
                f"{len(self.kept)} places (Backprop(keep=...)). Make the Backprop with "
                "keep=None (the default) for paths and branch tables."
            )

    # -- lookup -----------------------------------------------------------------
    def node(self, where) -> torch.fx.Node:
        """The graph node for an input position/keyword, a module path or a node name.

        Examples:
            >>> res.node("input_ids").name
            'kwargs_input_ids'
            >>> res.node("bert.embeddings.word_embeddings").meta["val"].shape
            torch.Size([1, 11, 16])
        """
        return find_node(self.graph, where)

    def value(self, where, semiring: Semiring):
        """The raw semiring value (tuple of fields) at ``where``.

        Examples:
            >>> hi, lo = res.value("bert.embeddings.word_embeddings", sbp.MaxProduct())[:2]
            >>> bool((lo <= hi).all())
            True
        """
        node = self.node(where)
        if not isinstance(semiring, Semiring):
            raise InputError(
                f"semiring must be a Semiring instance such as Real() or MaxProduct(), got "
                f"{semiring!r}; computed in this pass: {self.semirings}"
            )
        try:
            k = self.semirings.index(semiring)
        except ValueError:
            raise InputError(
                f"{semiring} was not computed in this pass; computed: {self.semirings}"
            ) from None
        group = [n for n in self.graph.aliases.get(node, (node,)) if n in self._store]
        if not group and self.kept is not None and node not in self.kept:
            raise InputError(
                f"{where!r} was not kept: this pass kept only the places given in "
                "Backprop(keep=...); add it there, or use keep=None to keep everything"
            )
        if not group:
            raise InputError(self._why_missing(where, node))
        value = self._store[group[0]][k]
        for n in group[1:]:  # one tensor passed as several inputs: every path starts at one
            value = semiring.plus(value, self._store[n][k])
        stats = semiring.overflow_stats(value) if semiring.overflow == "end" else ()
        if stats and bool(overflowed(torch.stack(stats)).any()):  # (see engine.reverse)
            raise NonFiniteError(
                f"{semiring.name} overflowed at {where!r} (inf or NaN from finite forward "
                "values: path products beyond the float range). Run the model and inputs "
                "in float64, or use a log-space semiring (MaxAbs, LogAbs)."
            )
        return value

    def at(self, where, semiring: Semiring):
        """The readout of ``semiring`` at ``where`` (see each semiring's readout).

        Examples:
            >>> res.at("bert.embeddings.word_embeddings", sbp.MaxProduct()).hi.shape
            torch.Size([1, 11, 16])
        """
        value = self.value(where, semiring)  # (checks ``semiring`` first)
        return semiring.finalize(value)

    def aggregate(self, where, semiring: Semiring, dims=(-1,)):
        """⊕ of the values over ``dims`` (the paper's aggregated derivative, Eq. 3).

        Examples:
            The best path product per token (⊕ of MaxProduct over the hidden units):

            >>> top = res.aggregate("bert.embeddings.word_embeddings", sbp.MaxProduct())
            >>> top.hi.shape
            torch.Size([1, 11])
            >>> per_unit = res.at("bert.embeddings.word_embeddings", sbp.MaxProduct()).hi
            >>> torch.equal(top.hi, per_unit.amax(-1))
            True
        """
        v = self.value(where, semiring)
        return semiring.finalize(semiring.sum(v, check_dims(dims, self.node(where), where)))

    @property
    def needed(self) -> frozenset:
        """Nodes the pass carried values for (float, on a path from an input)."""
        if not hasattr(self, "_needed"):
            from .engine.reverse import needed_nodes

            self._needed = needed_nodes(self.graph, self.graph.output_node)
        return self._needed

    # -- circuits: the forward pass and max-marginals --------------------------------
    def alpha(self, where, semiring: Semiring, seed="structural", baseline=None):
        """The forward semiring pass's readout at ``where``: ⊕ over the paths from the
        sources (where this pass's paths end: float inputs, looked-up embeddings) to it.

        ``seed``: ``"structural"`` (each path counts as its edges alone), ``"x"`` (each
        path also times the source element it starts from), or ``{place: tensor}`` (only
        those places start paths); ``baseline={place: x'}`` with ``seed="x"`` seeds
        those places with ``x - x'``. Any semiring, computed once per seed and kept.

        Examples:
            Under Real with the input as seed, alpha is the forward-mode derivative in
            the direction x (``torch.func.jvp(mlp, (x,), (x,))``): at the output, the
            sum over paths of their products times the input they start from:

            >>> a = mlp_res.alpha("2", sbp.Real(), seed="x")     # at the MLP's output
            >>> torch.allclose(a[0, 1], (paths * x[0]).sum())
            True
        """
        from .engine import marginals

        self._require_all("alpha")
        _check_semiring(semiring)
        node = self.node(where)
        return semiring.finalize(marginals.alpha_at(self, node, semiring, seed, baseline))

    def marginal(self, where, semiring: Semiring, seed="structural", baseline=None, into=None):
        """The ⊕ over the whole paths (source to output) through each element of
        ``where``: ``alpha ⊗ D``. Under MaxProduct the best path through it (hi and lo
        combined by sign), under Real the total flow through it, under Entropy the
        entropy of the paths through it, under TopK the k heaviest. With ``into`` (an
        op reading ``where``), only the paths that go from ``where`` straight into
        ``into`` (the edges between them), per element of ``where``. ``seed`` and
        ``baseline`` as for [alpha][semiring_backprop.Result.alpha].

        Examples:
            The best path through each hidden unit of the MLP (after its tanh):

            >>> best = mlp_res.marginal("1", sbp.MaxProduct())
            >>> torch.allclose(best.hi[0], paths.amax(1)), torch.allclose(best.lo[0], paths.amin(1))
            (True, True)
        """
        from .engine import marginals

        self._require_all("marginal")
        node = self.node(where)
        if into is not None:
            self.value(into, semiring)  # (checks ``semiring`` and that D is there)
            value = marginals.edge_marginal(self, node, self.node(into), semiring, seed, baseline)
            return semiring.finalize(value)
        if node not in self.needed:
            self.value(where, semiring)  # (explains why there is no value)
        return semiring.finalize(marginals.marginal_value(self, node, semiring, seed, baseline))

    # -- analysis -----------------------------------------------------------------
    def top_path(self, source, semiring: Semiring | None = None, sign: str = "+"):
        """The heaviest path from ``source`` to the output, as a
        [Path][semiring_backprop.Path].

        ``source`` is a place (``"encoder.layer.0.attention:input"``, an input position)
        or ``(place, index)``; an index prefix (``(0, 3)``: all hidden units of token 3)
        or slices name a set, and the path starts at its best element. ``semiring`` is
        ``MaxProduct()`` (default; ``sign="-"`` gives the most negative path), a
        ``MaxProduct("tensor")`` (a sequence of ops), ``MaxAbs()`` or ``TopK(k)``.

        Examples:
            The best path from token 2 (any of its hidden units):

            >>> path = res.top_path(("bert.embeddings.word_embeddings", (0, 2)))
            >>> path
            <Path MaxProduct(neuron) +: 95 steps, product 0.000115082>
            >>> top = res.aggregate("bert.embeddings.word_embeddings", sbp.MaxProduct())
            >>> path.value == top.hi[0, 2].item()
            True
            >>> res.top_path(("bert.embeddings.word_embeddings", (0, 2)), sign="-").value < 0
            True
        """
        from .analysis import paths

        self._require_all("top_path")
        try:
            return _read_from(self, paths.top_path(self, source, semiring, sign))
        except PathMismatchError as e:
            why = _underflow(self, source, semiring)
            if why is None:
                raise
            said = str(e).split(" The result does not hold together")[0]  # not "changed"
            raise PathMismatchError(f"{why} ({said})") from None

    def top_paths(self, source, k: int, semiring: Semiring | None = None) -> list:
        """The ``k`` heaviest distinct paths by |product| from ``source`` (needs ``TopK``).

        Examples:
            >>> res.top_paths("bert.embeddings.word_embeddings", 2)
            [<Path TopK(2) -: 70 steps, product -0.675802>,
             <Path TopK(2) +: 70 steps, product 0.574383>]
        """
        from .analysis import paths

        self._require_all("top_paths")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InputError(f"top_paths: k={k!r} is the number of paths to return: 1 or more")
        return [_read_from(self, p) for p in paths.top_paths(self, source, k, semiring)]

    def branches(self, where, semiring: Semiring | None = None, aggregate: str = "oplus",
                 roles=None, by: str = "consumer", per_head: bool = False,
                 heads=None):  # fmt: skip
        """Tidy DataFrame (``token``, ``consumer``, ``role``, ``value``, ``winner``,
        ``path``, ``semiring``): the ⊕ over paths from ``where`` that leave through each
        consumer. ``path`` is False where the value is the semiring's zero: no path
        leaves the token through that branch (for ``Entropy``, ``LogAbs``, no path of
        nonzero weight), which a value of 0 alone cannot tell apart from a real 0.

        ``aggregate="oplus"``: ⊕ over each token's hidden units, per branch (``winner``
        marks the branch holding the token's best value). ``"bucket_sum"``: each hidden
        unit's value is added to the branch that wins it (selective semirings only).
        ``"paper"``: the paper's bars (its ``compute_oplus_max_grad``): the token's best
        hidden unit (the argmax of D over them) gives its value to the branch that wins
        that unit's ⊕, and every other branch has 0 (zeros are values here: the paper
        averaged them in); with ``MaxProduct("tensor")`` and ``paper=True`` this is the
        paper's quantity. Ties (a 0 from two branches) go to the first branch listed.
        ``roles``: ``{"module regex": "query", ...}`` or a function of the module path,
        tried before the built-in names. ``by="role"``: one row per role, the ⊕ of the
        consumers that share it (a gated MLP's ``gate_proj`` and ``up_proj``).

        ``per_head=True`` adds a ``head_index`` column (not ``head``: that would shadow
        ``DataFrame.head()``) and splits the query, key and value
        branches by attention head: head ``h``'s row is the ⊕ over the paths through
        head ``h``'s columns of the projection's output (fused projections too). Under
        grouped-query attention the key and value heads are the K/V heads. The rows
        still partition the paths: their ⊕ is D at ``where``. The number of heads comes
        from the attention module or the model's config; ``heads=`` gives it (an int:
        query heads; ``{"query": 8, "key": 2, "value": 2}``).

        Examples:
            >>> t = res.branches("bert.encoder.layer.0:input", sbp.MaxProduct())
            >>> print(t[t.token == 6][["consumer", "role", "value", "winner"]].to_string())
                                                 consumer   role         value  winner
            24      bert.encoder.layer.0.attention.output   skip  1.955721e-02    True
            25  bert.encoder.layer.0.attention.self.query  query  2.344730e-08   False
            26    bert.encoder.layer.0.attention.self.key    key  1.024582e-08   False
            27  bert.encoder.layer.0.attention.self.value  value  3.545691e-06   False
            >>> heads = res.branches("bert.encoder.layer.0:input", sbp.MaxProduct(),
            ...                      per_head=True)
            >>> sorted(int(h) for h in heads["head_index"].dropna().unique())
            [0, 1]
        """
        from .analysis import branches

        self._require_all("branches")
        _check_roles(roles)
        from .views.table import branch_table  # (imported when a result is drawn)

        table = branches.branches(self, where, semiring, aggregate, roles, by=by,
                                  per_head=per_head, heads=heads)  # fmt: skip
        return _with_mask(self, branch_table(table))

    def layer_table(self, semirings=None, aggregate: str = "oplus", tokens=None, roles=None,
                    sublayers=("attention", "mlp"), by: str = "consumer",
                    per_head: bool = False, heads=None):  # fmt: skip
        """Tidy DataFrame (``layer``, ``sublayer``, ``token``, ``token_text``, ``branch``,
        ``consumer``, ``value``, ``winner``, ``path``, ``semiring``) for every attention block:
        branches at the block's input (skip/query/key/value) and at the input of its MLP
        sublayer (skip/mlp). ``tokens``: the token strings, for ``token_text``.
        ``per_head``, ``heads``: a ``head_index`` column, as in
        [branches][semiring_backprop.Result.branches].

        Examples:
            >>> t = res.layer_table(semirings=[sbp.MaxProduct()], tokens=tokens)
            >>> t = t[(t.token == 6) & t.winner]     # the branch that wins at the mask
            >>> print(t[["layer", "sublayer", "token_text", "branch", "value"]].to_string())
                layer   sublayer token_text branch     value
            24      0  attention     [MASK]   skip  0.019557
            56      0        mlp     [MASK]   skip  0.019564
        """
        from .analysis import branches

        self._require_all("layer_table")
        _check_roles(roles)
        if isinstance(sublayers, str) or not set(sublayers) or not set(sublayers) <= SUBLAYERS:
            raise InputError(
                f"sublayers={sublayers!r}: give some of {SUBLAYERS_SHOWN} as a tuple, e.g. "
                "sublayers=('attention',)"
            )
        from .views.table import branch_table  # (imported when a result is drawn)

        table = branches.layer_table(self, semirings, aggregate, tokens, roles, sublayers, by,
                                     per_head, heads)  # fmt: skip
        return _with_mask(self, branch_table(table))

    def _why_missing(self, where, node) -> str:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            return (
                f"{where!r} is a {val.dtype} tensor (e.g. token ids): it has no edges. Ask for "
                "the embeddings instead, e.g. res.at('embeddings', ...) or the word "
                "embedding module's output."
            )
        return (
            f"the output does not depend on {where!r} through the model's inputs (it is not "
            "on any path to the output, or depends on weights only), so it has no value."
        )

    def __repr__(self) -> str:
        names = ", ".join(sr.name for sr in self.semirings)
        return f"Result({len(self._store)} nodes; {names})"

    # -- views --------------------------------------------------------------------
    def view(self, quantity: str | None = None, *, source=None, tokens=None):
        """Token strips coloured by a per-token quantity (``"gradient"``, ``"top_path"``,
        ``"entropy"``, ``"normalized_entropy"``; None: all this result has), at
        ``source`` (default: the float input or the word embeddings); ``tokens`` one
        list of strings per example. See [views][semiring_backprop.views].

        Examples:
            >>> print(res.view("top_path", tokens=tokens))
            Result: 182 nodes; Real, MaxProduct(neuron), TopK(2), Entropy, PathCount
            <BLANKLINE>
            top path ...
        """
        from . import views  # (imported when a result is drawn)

        return views.result(self, quantity, source=source, tokens=tokens)

    def _repr_html_(self) -> str:
        try:
            return self.view()._repr_html_()
        except SemiringBackpropError as e:  # a notebook shows the reason, not a traceback
            return f"<pre>{_html_escape(repr(self))}\n(no token view: {_html_escape(e)})</pre>"

    def to_html(self, file, quantity: str | None = None, *, source=None, tokens=None) -> str:
        """Write [view][semiring_backprop.Result.view] to one self-contained HTML file;
        returns its path.

        Examples:
            >>> res.to_html("api-result.html", tokens=tokens)
            'api-result.html'
        """
        return self.view(quantity, source=source, tokens=tokens).to_html(file)


def _with_mask(res: Result, table):
    """``table`` with the call's attention mask in ``attrs["attention_mask"]`` where it
    pads: the rows stay (they index the tensors), and the table's views leave them out."""
    from .analysis.readouts import token_mask

    mask = token_mask(res)
    if mask is not None:
        table.attrs["attention_mask"] = mask
    return table


def _underflow(res: Result, source, semiring) -> str | None:
    """Why a MaxProduct path does not reproduce its stored value, where the cause is
    that path products fell below the dtype's smallest normal number (a deep float32
    chain of small weights): they are stored as plain numbers, unlike MaxAbs's logs."""
    from .semirings import MaxProduct

    semiring = MaxProduct() if semiring is None else semiring
    if not isinstance(semiring, MaxProduct) or semiring not in res.semirings:
        return None
    where = source[0] if isinstance(source, tuple) and len(source) == 2 else source
    try:
        hi, lo = res.value(where, semiring)[:2]
    except SemiringBackpropError:
        return None
    if not hi.is_floating_point() or hi.dtype == torch.float64:
        return None
    tiny = torch.finfo(hi.dtype).tiny
    small = ((hi.abs() < tiny) & torch.isfinite(hi)) | ((lo.abs() < tiny) & torch.isfinite(lo))
    if not bool(small.any()):
        return None
    return (
        f"the path products underflow {hi.dtype}: {semiring.name} keeps products as plain "
        f"numbers, and below {tiny:.3g} (the smallest normal {hi.dtype} number; a deep "
        "chain of small weights gets there) they lose their digits or become 0, so the "
        "path read back does not match the stored value. Explain the model in float64 "
        "(model.double() and float64 inputs), or use MaxAbs(), LogAbs() or TopK(k), which "
        "keep log |product| and cannot underflow"
    )


def _read_from(res: Result, path):
    """The path remembers (weakly) the result it was read from, so that printing it and
    its views name branches and heads as ``Result.branches`` finds them, not by module
    names alone."""
    object.__setattr__(path, "_origin", weakref.ref(res))
    return path


def _html_escape(text) -> str:
    import html

    return html.escape(str(text))


SUBLAYERS = frozenset({"attention", "mlp"})
SUBLAYERS_SHOWN = "'attention', 'mlp'"


def _check_roles(roles) -> None:
    if roles is not None and not isinstance(roles, dict) and not callable(roles):
        raise InputError(
            f"roles={roles!r}: give a dict {{'module regex': 'query', ...}} or a function "
            "from a module path to a role name"
        )


def _check_semiring(semiring) -> None:
    if not isinstance(semiring, Semiring):
        raise InputError(
            f"semiring must be a Semiring instance such as Real() or MaxProduct(), got {semiring!r}"
        )
