"""Circuits: the components of a model (attention heads, MLPs) through which the
explained output flows, with the edges between them, from one semiring pass
(DESIGN §3b).

:func:`circuit` runs the pass and builds a :class:`Circuit`: per site (a component at a
position; the token embeddings; the target) the ⊕ of the whole paths through it, per
edge between sites the ⊕ of the whole paths through it, under each semiring (Real: the
total flow; MaxProduct: the best path's product, signed). ``prune`` keeps the
strongest components; the circuit draws itself (``_repr_html_``, ``to_html``) and
writes EAP-IG / MIB graph JSON, circuit-tracer / Neuronpedia attribution graph JSON,
networkx graphs and Graphviz DOT (:mod:`.exports`, :mod:`.graphs`).

The best whole paths through components are not read off the edges: an edge's value is
the best path through that edge, and chaining edges does not give a path's value (a
path must enter and leave a site through the same element). ``Circuit.top_paths`` reads
the exact best paths element by element from the pass and names the sites each passes
(:mod:`.paths`).

For example (``tests/test_circuit.py`` runs it on a small BERT)::

    c = sbp.circuit(model, kwargs={"input_ids": ids}, output=margin, tokens=tokens)
    small = c.prune(cumulative=0.8)
    small.to_html("circuit.html")
    small.to_eap_json("circuit.json")
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InputError
from . import exports, graphs, paths, prune
from .exports import ATTENTION_COLUMNS, COMPONENT_ROLES, EDGE_COLUMNS, NODE_COLUMNS

__all__ = ["Circuit", "circuit"]


def _frame(frame, columns, what):
    import pandas as pd

    if frame is None:
        return pd.DataFrame({c: pd.Series(dtype="object") for c in columns})
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise InputError(f"circuit {what}: missing columns {missing} (expected {list(columns)} "
                         "and one value column per semiring)")  # fmt: skip
    return frame.reset_index(drop=True)


def _name(sr) -> str:
    return sr if isinstance(sr, str) else sr.name


@dataclass
class Circuit:
    """Sites, edges and attention edges of a circuit, as DataFrames (the columns of
    ``.nodes.circuit_nodes`` and ``.edges``), one value
    column per semiring. ``tokens``: the text's tokens; ``what``: the explained output
    in words; ``mask``: 1 per token, 0 per padding position (padding has no sites);
    ``model_id``: the model's name, where known; ``source``: the circuit this one was
    pruned from (None: this is whole). ``seed``, ``ig_steps``, ``ig_method``: how the
    paths were seeded (``"x"``, ``"structural"``, ``"x - x'"`` with a baseline, or
    ``"custom"`` for a dict of places; the integrated-gradients steps of Real, 0 for
    none, and their quadrature, ``""`` for none), as the exports and the drawing say.

    Examples:
        >>> c = sbp.Circuit.from_result(res, [sbp.Real(), sbp.MaxProduct()], tokens=tokens)
        >>> c                                  # 11 tokens x (2 heads + the MLP)
        <Circuit: 33 of 33 head/MLP sites, ... edges; Real, MaxProduct(neuron)>
        >>> small = c.prune(top_n=3)           # the three strongest sites under Real
        >>> small
        <Circuit: 3 of 33 head/MLP sites, ... edges; Real, MaxProduct(neuron)>
        >>> cfg = small.to_eap_json()["cfg"]
        >>> [cfg[k] for k in ("n_layers", "n_heads", "d_model", "seed", "ig_steps")]
        [1, 2, 16, 'x', 0]
    """

    nodes: object
    edges: object = None
    attention_edges: object = None
    semirings: list | None = None
    tokens: list | None = None
    result: object = field(default=None, repr=False)
    what: str = ""
    token_ids: list | None = None
    mask: list | None = None
    d_model: int | None = None
    model_id: str = ""
    source: Circuit | None = field(default=None, repr=False)
    seed: str = "x"
    ig_steps: int = 0
    ig_method: str = ""

    def __post_init__(self):
        self.nodes = _frame(self.nodes, NODE_COLUMNS, "nodes")
        self.edges = _frame(self.edges, EDGE_COLUMNS, "edges")
        self.attention_edges = _frame(self.attention_edges, ATTENTION_COLUMNS,
                                      "attention edges")  # fmt: skip
        if self.semirings is None:
            self.semirings = [c for c in self.nodes.columns if c not in NODE_COLUMNS]
        for frame, what in ((self.nodes, "nodes"), (self.edges, "edges"),
                            (self.attention_edges, "attention edges")):  # fmt: skip
            gone = [n for n in self.names if n not in frame.columns]
            if gone and len(frame):
                raise InputError(f"circuit {what}: no column for {gone}")
        if self.mask is not None:
            pad = {p for p, m in enumerate(self.mask) if not m}
            self.nodes = self.nodes[~self.nodes.position.isin(pad)].reset_index(drop=True)
            self.edges = self.edges[~self.edges.position.isin(pad)].reset_index(drop=True)
            a = self.attention_edges
            self.attention_edges = a[~(a.src_position.isin(pad) | a.dst_position.isin(pad))
                                     ].reset_index(drop=True)  # fmt: skip

    # -- building ---------------------------------------------------------------------

    @classmethod
    def from_result(cls, res, semirings=None, seed="x", baseline=None, tokens=None,
                    heads=None, roles=None, *, edges=None, attention_edges=None,
                    what: str = "", mask=None, ig_steps: int = 0,
                    ig_method: str = "gausslegendre") -> Circuit:  # fmt: skip
        """The circuit of a pass (``sbp.backprop``'s Result): sites from
        ``.nodes.circuit_nodes``, edges from ``.edges`` (or
        the frames given), with ``seed``, ``baseline``, ``heads`` and ``roles`` as
        there. ``semirings``: those of the pass to read (default: all).

        ``ig_steps=N`` (with ``baseline``): the Real column summed over ``N``
        integrated-gradients steps from the baseline to the input (``ig_method``: the
        quadrature, Captum's names), i.e. each site's conductance; the other semirings
        are read at the input, and each frame's ``attrs["notes"]`` says so per column
        (:mod:`.ig`). ``ig_steps=0``: the seed ``x - x'`` at the input alone."""
        from ..engine.checkpoints import untap
        from ..engine.marginals import at_sources
        from .ig import check_steps, integrated
        from .layout import pinned
        from .nodes import circuit_nodes

        check_steps(ig_steps, ig_method)
        srs = list(semirings) if semirings is not None else list(res.semirings)
        whole, res = res, pinned(res)  # every stage reads the pass's segments, once
        baseline = at_sources(res, baseline)  # the model's inputs: x' where paths start
        kw = {"seed": seed, "baseline": baseline, "tokens": tokens, "heads": heads,
              "roles": roles}  # fmt: skip
        if ig_steps:
            nodes, edges, attention_edges = integrated(
                res, srs, baseline, ig_steps, ig_method, seed=seed, tokens=tokens,
                heads=heads, roles=roles, edges=edges, attention_edges=attention_edges)  # fmt: skip
        else:
            nodes = circuit_nodes(res, srs, **kw)
        if edges is None or attention_edges is None:
            from . import attention_edges as ae
            from . import edges as ce

            if edges is None:
                edges = ce.circuit_edges(res, srs, **kw)
            if attention_edges is None:
                attention_edges = ae.attention_edges(res, srs, **kw)
        emb = nodes[nodes.role == "embedding"].node
        d_model = None
        if len(emb):
            shape = res.values[res.node(emb.iloc[0].split("+")[0])].shape
            d_model = int(shape[-1])
        ids = _token_ids(res)
        labels = list(nodes[nodes.role == "embedding"].token)
        untap(whole.values)  # (a tapped pass: the circuit keeps its checkpoints alone)
        return cls(nodes, edges, attention_edges, srs, labels, whole, what, ids, mask, d_model,
                   seed=_seed_name(seed, baseline), ig_steps=ig_steps,
                   ig_method=ig_method if ig_steps else "")  # fmt: skip

    # -- reading ----------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The value columns (one per semiring)."""
        return [_name(s) for s in self.semirings]

    def column(self, semiring=None) -> str:
        """The value column of ``semiring`` (an object or its name; default Real where
        computed, else the first)."""
        names = self.names
        if not names:
            raise InputError("this circuit has no value column (no semiring)")
        if semiring is None:
            return "Real" if "Real" in names else names[0]
        want = _name(semiring)
        if want in names:
            return want
        if want == "MaxProduct":
            found = [n for n in names if n.startswith("MaxProduct")]
            if found:
                return found[0]
        raise InputError(f"semiring {want!r} is not in this circuit (it has {names})")

    @property
    def full(self) -> Circuit:
        """The whole circuit this one was pruned from (itself when whole)."""
        return self.source if self.source is not None else self

    @property
    def weights(self) -> str:
        """The edge weights of the pass it was read from (DESIGN §3c): ``"gradient"`` or
        ``"relevance"``."""
        return getattr(getattr(self.full.result, "graph", None), "weights", "gradient")

    @property
    def seeding(self) -> str:
        """How the paths were seeded, in words (``""`` for the default, the seed ``x``
        at the input), e.g. ``"seed x - x' (baseline), 8 IG steps (gausslegendre; Real
        only)"``."""
        said = [] if self.seed == "x" else [f"seed {self.seed}" + (
            " (baseline)" if self.seed == "x - x'" else "")]  # fmt: skip
        if self.weights == "relevance":
            said.append("relevance weights (norms' scale and the attention pattern held: "
                        "nothing reaches a query or a key)")  # fmt: skip
        if self.ig_steps:
            only = "; Real only" if self.names != ["Real"] else ""
            said.append(f"{self.ig_steps} IG steps ({self.ig_method}{only})")
        return ", ".join(said)

    @property
    def n_layers(self) -> int:
        target = self.full.nodes[self.full.nodes.role == "target"]
        if len(target):
            return int(target.layer.iloc[0])
        layers = self.full.nodes.layer.dropna()
        return int(layers.max()) + 1 if len(layers) else 0

    @property
    def n_heads(self) -> int:
        heads = self.full.nodes[self.full.nodes.role == "head"]["head_index"].dropna()
        return int(heads.max()) + 1 if len(heads) else 0

    @property
    def token_list(self) -> list[str]:
        """The tokens, one per position (padding included)."""
        if self.tokens is not None:
            return [str(t) for t in self.tokens]
        rows = self.full.nodes[self.full.nodes.role == "embedding"]
        return [str(t) for t in rows.sort_values("position").token]

    @property
    def prompt(self) -> str:
        """The text, as people read its tokens (padding left out)."""
        from ..tokens import readable_tokens, text_of

        shown = readable_tokens(self.token_list)
        return text_of(t for t, m in zip(shown, self.mask or [1] * len(shown)) if m)

    @property
    def last_position(self) -> int:
        pos = self.full.nodes.position.dropna()
        return int(pos.max()) if len(pos) else 0

    def components(self):
        """The rows of ``nodes`` that are heads or MLPs."""
        return self.nodes[self.nodes.role.isin(COMPONENT_ROLES)]

    def top_paths(self, k: int = 1, semiring=None, seed="x", *, heads=None,
                  roles=None) -> paths.CircuitPaths:  # fmt: skip
        """The ``k`` best whole paths (any token embedding to the output, by |product|),
        each as the sites it passes: a list of :class:`~.paths.CircuitPath`, best
        first, with ``to_frame()`` (one row per path and site) and ``to_json()``.

        Exact: these are the ``k`` best element paths of the pass, read from its
        back-pointers (``k=1``: MaxProduct, both signs; ``k > 1``: ``TopK(k')``,
        ``k' >= k``, which ``sbp.circuit(..., semirings=[..., sbp.TopK(k)])`` computes),
        each projected onto the sites it passes; two of them may pass the same sites
        (they differ inside a component, or start at two sources of one embedding site,
        e.g. the word and the token-type embedding): nothing is merged. ``seed``: ``"x"`` (default,
        as ``sbp.circuit``'s; each path times its source element's value, so the best
        path's value is the target's MaxProduct value where the token embeddings are the
        only sources) or ``"structural"`` (the product
        alone, as ``Result.top_path``). ``heads``, ``roles``: as the circuit was built.
        Padding positions start no path.

        Examples:
            >>> c = sbp.Circuit.from_result(res, [sbp.MaxProduct()], tokens=tokens)
            >>> best = c.top_paths()
            >>> best
            [<CircuitPath 1: 0.0138873, embedding@6 '[MASK]' → target>]
            >>> import math
            >>> math.isclose(best[0].value, c.nodes["MaxProduct(neuron)"].iloc[-1])  # the target's
            True

            Two paths of one product: from the word and from the token-type embedding
            (both are sources, added together):

            >>> two = c.top_paths(2, seed="structural")   # the pass has TopK(2)
            >>> two
            [<CircuitPath 1: -0.675802, embedding@6 '[MASK]' → target>,
             <CircuitPath 2: -0.675802, embedding@6 '[MASK]' → target>]
            >>> [p.path.source.module for p in two]
            ['bert.embeddings.word_embeddings', 'bert.embeddings.token_type_embeddings']
        """
        return paths.top_paths(self, k, semiring, seed, heads, roles)

    # -- pruning ----------------------------------------------------------------------

    def prune(self, top_n: int | None = None, threshold: float | None = None,
              cumulative: float | None = None, semiring=None) -> Circuit:  # fmt: skip
        """A new circuit keeping the components (heads and MLPs, each at one position;
        the embeddings, residual streams and target always stay) whose |value| under
        ``semiring`` (default Real) is among the ``top_n`` largest, at least
        ``threshold``, or among the largest that together make up ``cumulative`` (a
        share, 0 to 1) of the total |value| of all components; several criteria: all
        must hold. Sites of no path (non-finite values) are never kept; only sites are
        ranked (a head's value at a position already counts every path through what it
        reads), and the edges follow from them.

        A head's site is the position ``p`` where it writes; it reads its query at
        ``p`` and its keys and values at the positions its attention reaches. So an
        attention edge ``q -> p`` stays when the head is kept at ``p`` (and the pair
        carries a value: finite and non-zero under some semiring, not masked); an edge
        into the head's key or value input at ``q`` stays when a kept attention edge
        of that head reads ``q`` (or the head is kept at ``q``); an edge into its query,
        an MLP or the target, at its own position. Every edge also needs its source
        kept at its position (the embeddings always are). ``read_sites()`` lists the
        positions read where the head itself is not kept.

        ``prune(top_n=10)``: the ten strongest sites; ``prune(cumulative=0.9)``: the
        fewest that carry 90 % of |Real| (the class's example runs one).
        """
        return prune.prune(self, top_n, threshold, cumulative, semiring)

    def read_sites(self) -> list[dict]:
        """Where the kept heads read keys and values without being kept there (none in
        a whole circuit): :func:`.exports.read_sites`, a dict per head and position."""
        return exports.read_sites(self)

    def _keeping(self, kept_rows) -> Circuit:
        """A new circuit keeping the components ``kept_rows`` (:func:`.prune.keeping`)."""
        return prune.keeping(self, kept_rows)

    # -- exports ----------------------------------------------------------------------

    def to_networkx(self):
        """A ``networkx.MultiDiGraph`` of the sites and edges (:mod:`.graphs`)."""
        return graphs.to_networkx(self)

    def to_dot(self, semiring=None) -> str:
        """Graphviz DOT text of the sites and edges, coloured by ``semiring``'s values."""
        return graphs.to_dot(self, semiring)

    def to_eap_json(self, path=None, semiring=None) -> dict:
        """EAP-IG / MIB graph JSON (``Graph.from_json`` reads it): scores under
        ``semiring`` (default Real), ⊕ over positions; ``in_graph``, this circuit's
        components and edges. Written to ``path`` when given; returns the dict."""
        graph = exports.eap_graph(self, semiring)
        if path is not None:
            from .._files import write_user_file

            text = exports.eap_json(graph)
            write_user_file(path, lambda tmp: tmp.write_text(text), "circuit.json")
        return graph

    def to_neuronpedia(self, where=None, semiring=None, slug: str = "circuit",
                       scan: str = "") -> dict:  # fmt: skip
        """circuit-tracer / Neuronpedia attribution graph JSON of this circuit's sites
        (``scan``: the model's name). ``where``: a ``.json`` file, or a directory (then
        ``{slug}.json`` and ``graph-metadata.json``, as circuit-tracer writes them).
        Returns the dict."""
        if where is not None:
            return exports.save_neuronpedia(self, where, semiring, slug=slug, scan=scan)
        return exports.neuronpedia_graph(self, semiring, slug=slug, scan=scan)

    # -- views ------------------------------------------------------------------------

    def view(self, semiring=None, max_edges: int = 300):
        """The circuit drawn (:func:`semiring_backprop.circuits.view.circuit_view`)."""
        from .view import circuit_view

        return circuit_view(self, semiring, max_edges=max_edges)

    def _repr_html_(self) -> str:
        return self.view()._repr_html_()

    def to_html(self, path, semiring=None) -> str:
        """Write the drawing to one self-contained HTML file; returns its path."""
        return self.view(semiring).to_html(path)

    def __repr__(self) -> str:
        comps = self.components()
        return (f"<Circuit: {len(comps)} of {len(self.full.components())} head/MLP sites, "
                f"{len(self.edges)} edges; {', '.join(self.names)}>")  # fmt: skip


def _seed_name(seed, baseline) -> str:
    """The ``seed`` a circuit records: the seed's name, ``"x - x'"`` with a baseline."""
    if baseline is not None:
        return "x - x'"
    return seed if isinstance(seed, str) else "custom"


def _token_ids(res) -> list | None:
    from ..errors import NotFoundError

    try:
        ids = res.values[res.node("input_ids")]
    except (NotFoundError, InputError, KeyError):  # no input_ids (a float input): no ids
        return None
    return [int(i) for i in ids.reshape(-1).tolist()] if ids.dim() <= 2 else None


def circuit(model, args=(), kwargs=None, output=None, semirings=None, baseline=None,
            seed="x", tokens=None, heads=None, roles=None, what: str = "",
            ig_steps: int = 0, ig_method: str = "gausslegendre",
            weights: str = "gradient") -> Circuit:  # fmt: skip
    """Run ``sbp.backprop`` (``semirings``: default Real and MaxProduct) and build the
    :class:`Circuit` of one example (a batch of one). ``seed``: ``"x"`` (default; each
    source's own value), ``"structural"``, or with ``baseline`` the difference
    ``x - x'``: ``baseline`` is the corrupted input as the model takes it
    (``{"input_ids": corrupted_ids}``; inputs not given stay the clean ones), whose
    values where the paths start (the token embeddings) are computed, or
    ``{place: tensor}``, the values at places (e.g. ``{"model.embed_tokens": emb}``).
    ``tokens``: the token strings; ``heads``, ``roles``: as for ``layer_table``.
    ``ig_steps``, ``ig_method``: integrated-gradients steps for the seed (Real becomes
    each site's conductance; the other semirings stay at the input), as for
    :meth:`Circuit.from_result`. ``weights``: the edge weights of the pass (``"gradient"``,
    default, or ``"relevance"``: RelP's rules, as for ``backprop``).

    Examples:
        >>> c = sbp.circuit(model, kwargs=dict(enc), output=are_is, tokens=tokens)
        >>> c.names
        ['Real', 'MaxProduct(neuron)']
        >>> c.to_html("api-circuit.html")    # the drawing, one self-contained file
        'api-circuit.html'
    """
    from .._backprop import backprop
    from ..engine import checkpoints, relevance
    from ..semirings import MaxProduct, Real
    from .ig import check_call

    check_call(ig_steps, ig_method, baseline, seed)  # (before the pass)
    relevance.check(weights)
    if output is None and hasattr(model, "config"):  # a Hugging Face model's whole output
        raise InputError(
            "a circuit explains one number of the model's output: pass output=, a function "
            "of the output that returns it (e.g. output=lambda o: o.logits[0, -1, good] - "
            "o.logits[0, -1, bad], or sbp.WordChoice(...))"
        )
    srs = list(semirings) if semirings is not None else [Real(), MaxProduct()]
    # every stage reads every segment: the pass hands them all over (tapped) instead
    # of each being computed again from its checkpoints (the same peak: the stages hold
    # them all); the circuit keeps the checkpoints alone
    with checkpoints.tapped():
        res = backprop(model, args, kwargs, output=output, semirings=srs, weights=weights)
    mask = None
    m = (kwargs or {}).get("attention_mask")
    if m is not None and m.dim() == 2 and m.shape[0] == 1 and not bool((m != 0).all()):
        mask = [int(x != 0) for x in m[0].tolist()]
    return Circuit.from_result(res, srs, seed, baseline, tokens, heads, roles, what=what,
                               mask=mask, ig_steps=ig_steps, ig_method=ig_method)  # fmt: skip
