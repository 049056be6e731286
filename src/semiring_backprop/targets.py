"""What is explained: the scalar a pass starts from, as small named objects.

Each target is a callable of the model's output that returns one scalar, so it is used
as ``output=`` directly, and ``semiring_backprop.hf.explain.explain`` (the CLI's
``--task``) builds the same objects from words, label names and texts:

* ``WordChoice`` (``lm``): a sum of signed log-probabilities of vocabulary items at
  positions: ``log p(target) - log p(foil)``, where a word of several tokens counts as
  the sum of its pieces' log-probabilities;
* ``ClassLabel`` (``classification``): a label's logit or log-probability, or the
  margin between two labels;
* ``TokenLabel`` (``token``): the same at one position of a token classifier;
* ``Similarity`` (``similarity``): the cosine similarity of two texts' pooled
  embeddings; ``EmbeddingDim``: one dimension of a text's pooled embedding.

For example (each class's own docstring has an example that runs)::

    enc = tok("a fine film", return_tensors="pt")
    res = sbp.backprop(classifier, kwargs=dict(enc), output=ClassLabel(1, foil=0))
    pair = tok(["a fine film", "a good movie"], padding=True, return_tensors="pt")
    sim = Similarity(pair["attention_mask"], pooling="mean")
    res = sbp.backprop(encoder, kwargs=dict(pair), output=sim)
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from .errors import InputError

TASKS = ("lm", "classification", "similarity", "token")
POOLING = ("mean", "cls", "max", "lasttoken")
SCORES = ("logit", "logprob")


def output_field(out, name: str):
    """``out.logits`` / ``out.last_hidden_state`` of a model output, or its first item."""
    if isinstance(out, torch.Tensor):
        return out
    got = getattr(out, name, None)
    return got if got is not None else out[0]


# -- targets --------------------------------------------------------------------------


@dataclass(frozen=True)
class WordChoice:
    """``Σ sign · log p(token)`` over ``terms`` = ``((example, position, token_id, sign),
    ...)`` of a language model's logits (log-softmax over the vocabulary at each
    position). ``log p(are) - log p(is)`` at position 6 is
    ``WordChoice(((0, 6, id_are, 1), (0, 6, id_is, -1)))``.

    Examples:
        ``are_is`` is ``log p(are) - log p(is)`` at the mask of ``enc``:

        >>> are_is.terms == ((0, mask, tok.vocab["are"], 1), (0, mask, tok.vocab["is"], -1))
        True
        >>> out = model(**enc)
        >>> lp = out.logits[0, mask].log_softmax(-1)
        >>> torch.allclose(are_is(out), lp[tok.vocab["are"]] - lp[tok.vocab["is"]])
        True
        >>> r = sbp.backprop(model, kwargs=dict(enc), output=are_is, semirings=[sbp.Real()])
    """

    terms: tuple
    #: the same margin read from the logits themselves (``logit(are) - logit(is)``), as
    #: the paper's analysis took it (paper mode): equal in value where every position's
    #: signs cancel (required), but the graph has no log-softmax, whose paths through the
    #: log-sum-exp reach every logit and change what selective semirings find
    logits: bool = False

    def uneven(self) -> dict:
        """``{(example, position): net sign}`` where the signs do not cancel (empty: the
        margin of log-probabilities is the margin of logits)."""
        net: dict = {}
        for example, position, _, sign in self.terms:
            net[(example, position)] = net.get((example, position), 0) + sign
        return {k: v for k, v in net.items() if v != 0}

    def __post_init__(self):
        if self.logits:
            net = self.uneven()
            uneven = list(net)
            if uneven:
                raise InputError(
                    f"WordChoice(logits=True) reads a margin of logits, equal to the margin "
                    f"of log-probabilities only where each position's signs cancel; at "
                    f"(example, position) {uneven[0]} they sum to {net[uneven[0]]}. Give a "
                    "target and a foil at the same positions, or drop logits=True"
                )

    def __call__(self, out):
        logits = output_field(out, "logits")
        logp = {}
        total = 0
        for example, position, token, sign in self.terms:
            key = (example, position)
            if key not in logp:  # one log-softmax per position
                at = logits[example, position]
                logp[key] = at if self.logits else at.log_softmax(-1)
            total = total + sign * logp[key][token]
        return total


@dataclass(frozen=True)
class ClassLabel:
    """A sequence classifier's ``logits[example, label]`` (``score="logit"``) or its
    log-probability (``"logprob"``); with ``foil``, the margin ``label - foil`` (the
    same for both scores, unless ``multi_label``).

    ``multi_label=True`` (a head with ``config.problem_type ==
    "multi_label_classification"``, as ``explain`` reads it): the labels are
    independent, a label's probability is ``sigmoid(logit)``, and ``"logprob"`` is
    ``logsigmoid(logit)`` (with ``foil``, the difference of the two). A head with one
    output and softmax probabilities is refused under ``"logprob"``: the log-softmax of
    one number is always 0.

    Examples:
        The MLP's two outputs read as the logits of a two-class classifier:

        >>> y = mlp(x)
        >>> bool(sbp.ClassLabel(1, foil=0)(y) == y[0, 1] - y[0, 0])
        True
        >>> r = sbp.backprop(mlp, (x,), output=sbp.ClassLabel(1), semirings=[sbp.Real()])
        >>> torch.equal(r.at(0, sbp.Real()), mlp_res.at(0, sbp.Real()))   # y[0, 1]
        True
    """

    label: int
    foil: int | None = None
    score: str = "logit"
    example: int = 0
    multi_label: bool = False

    def __post_init__(self):
        check_score(self.score)

    def __call__(self, out):
        return _label_score(output_field(out, "logits")[self.example], self)


@dataclass(frozen=True)
class TokenLabel:
    """A token classifier's ``logits[example, position, label]`` (or log-probability;
    with ``foil``, the margin between two labels) at one position.

    Examples:
        Any output with ``logits`` of shape (examples, positions, labels) will do; here
        the masked LM's, its vocabulary as the labels:

        >>> out = model(**enc)
        >>> t = sbp.TokenLabel(mask, tok.vocab["are"], score="logprob")
        >>> torch.allclose(t(out), out.logits[0, mask].log_softmax(-1)[tok.vocab["are"]])
        True
    """

    position: int
    label: int
    foil: int | None = None
    score: str = "logit"
    example: int = 0
    multi_label: bool = False  #: labels independent: probability sigmoid(logit)
    multi_label: bool = False

    def __post_init__(self):
        check_score(self.score)

    def __call__(self, out):
        return _label_score(output_field(out, "logits")[self.example, self.position], self)


def _fields(self) -> tuple:
    """What decides a target's scalar: its fields (``backprop`` reuses a trace made
    for an equal target)."""
    return astuple(self)


WordChoice._trace_key = ClassLabel._trace_key = TokenLabel._trace_key = _fields


def check_score(score):
    if score not in SCORES:
        raise InputError(f"score={score!r}: choose one of {', '.join(SCORES)}")


ONE_OUTPUT = (
    "score='logprob' on a head with one output: the log-softmax of one number is always 0, "
    "so nothing would be explained. Explain its logit (score='logit', --score logit); "
    "a one-logit binary classifier whose probability is sigmoid(logit) is a multi-label "
    "head: set config.problem_type = 'multi_label_classification' (or multi_label=True)"
)


def _label_score(logits, t):
    if t.score == "logit":
        values = logits
    elif t.multi_label:  # independent labels: p = sigmoid(logit)
        values = torch.nn.functional.logsigmoid(logits)
    elif logits.shape[-1] == 1:
        raise InputError(ONE_OUTPUT)
    else:  # a margin of log-softmaxes is the margin of logits
        values = logits if t.foil is not None else logits.log_softmax(-1)
    value = values[t.label]
    return value if t.foil is None else value - values[t.foil]


class _Pooled:
    """Pooling of ``last_hidden_state`` as sentence-transformers does it, over each
    example's tokens only (the attention mask's ones, a contiguous run: left or right
    padding)."""

    def __init__(self, attention_mask, pooling="mean", normalize: bool = False):
        modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
        bad = [m for m in modes if m not in POOLING]
        if not modes or bad:
            raise InputError(
                f"pooling {pooling!r}: choose one of {', '.join(POOLING)} (or several, "
                "concatenated, as a tuple)"
            )
        mask = torch.as_tensor(attention_mask)
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        spans = []
        for row in mask.tolist():
            on = [i for i, m in enumerate(row) if m]
            if not on or on != list(range(on[0], on[-1] + 1)):
                raise InputError(
                    f"attention mask {row}: each example needs one run of ones (its tokens)"
                )
            spans.append((on[0], on[-1] + 1))
        self.pooling, self.normalize, self.spans = modes, bool(normalize), tuple(spans)

    def embeddings(self, out) -> list:
        """One pooled (and, if asked, normalized) vector per example."""
        h = output_field(out, "last_hidden_state")
        vectors = []
        for e, (a, b) in enumerate(self.spans):
            tokens = h[e, a:b]
            parts = [_pool(tokens, mode) for mode in self.pooling]
            v = parts[0] if len(parts) == 1 else torch.cat(parts)
            vectors.append(v / v.norm() if self.normalize else v)
        return vectors

    def _key(self):
        return (type(self).__name__, self.pooling, self.normalize, self.spans)

    def _trace_key(self):  # backprop reuses a trace made for an equal target
        return self._key()

    def __eq__(self, other):
        return isinstance(other, _Pooled) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


def _pool(tokens, mode: str):
    if mode == "mean":
        return tokens.mean(0)
    if mode == "max":
        return tokens.amax(0)
    if mode == "cls":
        return tokens[0]
    return tokens[-1]  # lasttoken


class Similarity(_Pooled):
    """Cosine similarity of the pooled embeddings of examples 0 and 1 of a batch of
    two texts (``attention_mask`` as the tokenizer gave it, padding=True).

    ``pooling``: ``"mean"``, ``"cls"``, ``"max"``, ``"lasttoken"``, or a tuple of them
    (concatenated, as sentence-transformers does when several modes are on).

    Examples:
        Two texts of different lengths in one padded batch, through the BERT encoder;
        the pooling counts each text's own tokens only:

        >>> texts = ["the keys to the cabinet are on the table", "a dog is on the table"]
        >>> pair = tok(texts, padding=True, return_tensors="pt")
        >>> sim = sbp.Similarity(pair["attention_mask"], pooling="mean")
        >>> sim
        Similarity(pooling=('mean',), normalize=False)
        >>> a, b = (model.bert(**tok(t, return_tensors="pt")).last_hidden_state[0].mean(0)
        ...         for t in texts)
        >>> torch.allclose(sim(model.bert(**pair)), torch.cosine_similarity(a, b, dim=0))
        True
        >>> r = sbp.backprop(model.bert, kwargs=dict(pair), output=sim,
        ...                  semirings=[sbp.MaxProduct()])
        >>> r.aggregate("embeddings.word_embeddings", sbp.MaxProduct()).hi.shape
        torch.Size([2, 11])
    """

    def __init__(self, attention_mask, pooling="mean", normalize: bool = False):
        super().__init__(attention_mask, pooling, normalize)
        if len(self.spans) != 2:
            raise InputError(
                f"Similarity compares two texts: the batch has {len(self.spans)}; tokenize "
                "[text_a, text_b] with padding=True"
            )

    def __call__(self, out):
        a, b = self.embeddings(out)
        return (a * b).sum() / (a.norm() * b.norm())

    def __repr__(self):
        return f"Similarity(pooling={self.pooling}, normalize={self.normalize})"


class EmbeddingDim(_Pooled):
    """Dimension ``dim`` of example ``example``'s pooled (and, with ``normalize``,
    unit-length) embedding.

    Examples:
        >>> pair = tok(["the keys are on the table", "a dog"], padding=True,
        ...            return_tensors="pt")
        >>> dim3 = sbp.EmbeddingDim(pair["attention_mask"], 3, pooling="cls", example=1)
        >>> dim3
        EmbeddingDim(3, pooling=('cls',), normalize=False)
        >>> alone = model.bert(**tok("a dog", return_tensors="pt")).last_hidden_state
        >>> torch.allclose(dim3(model.bert(**pair)), alone[0, 0, 3])
        True
    """

    def __init__(self, attention_mask, dim: int, pooling="mean", normalize=False, example=0):
        super().__init__(attention_mask, pooling, normalize)
        if not 0 <= example < len(self.spans):
            raise InputError(f"example {example}: the batch has {len(self.spans)} examples")
        self.dim, self.example = int(dim), int(example)

    def __call__(self, out):
        v = self.embeddings(out)[self.example]
        if not -v.shape[0] <= self.dim < v.shape[0]:
            raise InputError(
                f"embedding dimension {self.dim}: the pooled embedding has {v.shape[0]} "
                f"(0..{v.shape[0] - 1})"
            )
        return v[self.dim]

    def _key(self):
        return (*super()._key(), self.dim, self.example)

    def __repr__(self):
        return f"EmbeddingDim({self.dim}, pooling={self.pooling}, normalize={self.normalize})"
