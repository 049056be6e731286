"""Explain a Hugging Face model's choice: a word, a label, or the similarity of two texts.

The explained scalar (``task``, :mod:`semiring_backprop.targets`) is by default
``log p(target) - log p(foil)`` at the masked position (masked LM) or at the next
position (causal LM), as in the paper's subject-verb agreement study; or a class label's
logit, a token label's logit, or the cosine similarity of two texts' pooled embeddings.
One pass computes the chosen semirings; the result holds per-layer branch tables,
per-token entropy and the top gradient path, and writes them as JSON, CSV and PNG.

For example (``docs/quickstart.md`` runs it on a small model)::

    ex = explain("bert-base-uncased", "the keys to the cabinet [MASK] on the table",
                 target="are", foil="is")
    print(ex.report())
    ex.write("out/")
"""

from __future__ import annotations

from pathlib import Path as FilePath

import torch

from .._backprop import backprop
from ..engine import relevance
from ..errors import InputError
from ..semirings import Entropy, LogAbs, MaxAbs, MaxProduct, PathCount, Real, TopK
from . import gguf
from .explanation import Explanation
from .loading import Kept, check_device, lm_kind, load

SEMIRINGS = {
    "max": "MaxProduct: the top gradient path and per-layer branches",
    "entropy": "Entropy (+ PathCount): how gradient flow spreads over paths",
    "real": "Real: the gradient",
    "maxabs": "MaxAbs: the largest |path product|, in log space",
    "logabs": "LogAbs: log of the total absolute flow",
    "topk": "TopK(3): the three heaviest paths",
}


def semirings_for(names, granularity: str = "neuron") -> list:
    """Semiring objects for names of :data:`SEMIRINGS` (a list, or one name)."""
    if isinstance(names, str):  # one name, not its letters
        names = (names,)
    names = tuple(names)
    if len(names) > 1 and all(isinstance(n, str) and len(n) == 1 for n in names):
        spelled = "".join(names)
        raise InputError(
            f"semirings {names!r} are the letters of {spelled!r}: give a list of names, "
            f"semirings=[{spelled!r}]"
            + ("" if spelled in SEMIRINGS else f" ({', '.join(SEMIRINGS)})")
        )
    out = []
    for name in names:
        if name not in SEMIRINGS:
            raise InputError(f"unknown semiring {name!r}; choose from {', '.join(SEMIRINGS)}")
        out += {
            "max": [MaxProduct(granularity)],
            "entropy": [Entropy(), PathCount()],
            "real": [Real()],
            "maxabs": [MaxAbs()],
            "logabs": [LogAbs()],
            "topk": [TopK(3)],
        }[name]
    return list(dict.fromkeys(out))


def _paper_margin(prep):
    """Paper mode: a word's margin ``log p(are) - log p(is)`` is read from the logits
    (``logit(are) - logit(is)``, the same number), as the paper's analysis took it
    (``analyze_kvq.py``); its graph has no log-softmax. Where the signs do not cancel
    at each position (no foil; words of different pieces) the log-probabilities stay,
    since a margin of logits would be another number."""
    from dataclasses import replace

    from ..targets import WordChoice

    t = prep.target
    if not isinstance(t, WordChoice) or t.logits:
        return prep
    if t.uneven():
        return prep
    what = prep.what.replace("log p(", "logit(", 2)
    what += " (from the logits, as the paper did: the same number as the log-probabilities')"
    return replace(prep, target=replace(t, logits=True), what=what)


def explain(
    model,
    text: str,
    target: str | None = None,
    foil: str | None = None,
    *,
    tokenizer=None,
    semirings=("max", "entropy"),
    granularity: str | None = None,
    kind: str | None = None,
    dtype=torch.float32,
    device="cpu",
    model_id: str | None = None,
    task: str = "lm",
    text_pair: str | None = None,
    position: int | None = None,
    pooling=None,
    score: str = "logit",
    dim: int | None = None,
    per_head: bool = False,
    paper: bool = False,
    gguf_file: str | None = None,
    weights: str = "gradient",
) -> Explanation:
    """Explain one scalar of a Hugging Face model; ``model`` is a hub id, a local
    directory, or a loaded model (then pass ``tokenizer`` too). ``task`` picks the
    scalar (:mod:`semiring_backprop.targets`):

    * ``"lm"``: ``log p(target) - log p(foil)`` at the mask (masked LM) or the next
      position (causal LM); a word of several tokens counts as the sum of its pieces'
      log-probabilities (consecutive masks; teacher-forced next tokens). No ``foil``:
      ``log p(target)``. End tokens a tokenizer appends (``add_eos_token``) are
      dropped: a causal LM's next word follows the text.
    * ``"classification"``: the logit (``score="logprob"``: log-probability) of the
      label ``target`` (a name from ``config.id2label`` or an index; default: the
      predicted label), or the margin to the label ``foil``; ``text_pair``: the second
      text of a sentence pair.
    * ``"token"``: the same for a token classifier at token ``position``.
    * ``"similarity"``: the cosine similarity of the pooled embeddings of ``text`` and
      ``text_pair``, pooling read from a sentence-transformers checkpoint
      (``modules.json``) or given (``pooling="mean"``, ``"cls"``, ``"max"``,
      ``"lasttoken"``); ``dim=N``: dimension N of ``text``'s embedding instead.

    ``per_head=True``: the layer table splits the query, key and value branches by
    attention head (a ``head_index`` column). Padding (where the attention mask is 0) is
    no token: it is left out of every table, view and figure.

    ``semirings``: names from :data:`SEMIRINGS` (a list, or one name such as
    ``"max"``). ``granularity``: ``"neuron"`` (the default) or ``"tensor"``.

    ``paper=True``: paper mode (DESIGN §1): the model is traced as the paper's library
    (brunoflow) built its graph, at tensor granularity (so max-product values are
    brunoflow's; ``granularity="neuron"`` is refused), and beside ``layers`` (ours: ⊕
    over each token's hidden units, per branch) ``paper_layers`` holds the paper's
    per-token table (``aggregate="paper"``: the token's best hidden unit gives its value
    to the branch that wins it, every other branch 0, zeros kept; needs ``"max"``).

    ``weights``: what each edge weighs (DESIGN §3c): ``"gradient"`` (default) or
    ``"relevance"`` (the local rules of relevance propagation as RelP applies them, as for
    ``backprop``; not with ``paper=True``).

    A model given by name is kept (the last two, keyed on the name, the task, kind,
    dtype, device and, for a local directory, its files' sizes and times): a second
    call on it reuses the model, its trace and compiled kernels, and takes a fraction
    of the first call's time. :func:`clear_loaded` frees them; a model loaded yourself
    and passed with ``tokenizer=`` is reused the same way.

    For example (``docs/targets.md`` runs each task on a small model)::

        explain("bert-base-uncased", "the keys to the cabinet [MASK] here", "are", "is")
        explain(DIR, "a fine film", "positive", task="classification")
        explain(DIR, "a cat sat", text_pair="a dog sat", task="similarity")
    """
    from .. import targets
    from . import tasks

    if task not in targets.TASKS:
        raise InputError(f"task {task!r}: choose one of {', '.join(targets.TASKS)}")
    relevance.check(weights, paper)  # (before the model is loaded)
    if isinstance(model, str | FilePath):
        model_id = gguf.checkpoint(model, gguf_file)
        model, tokenizer, kind = _load_kept(model_id, task, kind, dtype, check_device(device))
    elif tokenizer is None:
        raise InputError("pass tokenizer= with a loaded model (or give a hub id / directory)")
    else:
        if task == "lm":
            kind = kind or lm_kind(model.config, tokenizer, type(model).__name__)
        _check_head(model, task)
        model = model.eval()
    model_id = model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__
    if paper and granularity not in (None, "tensor"):
        raise InputError(
            f"paper=True computes what the paper's library did, at tensor granularity; "
            f"granularity={granularity!r} contradicts it (leave it out, or drop paper=True)"
        )
    granularity = granularity or ("tensor" if paper else "neuron")
    srs = semirings_for(semirings, granularity)
    prep = tasks.prepare(task, model, tokenizer, text, target, foil, kind=kind,
                         text_pair=text_pair, position=position, pooling=pooling,
                         score=score, dim=dim, model_id=model_id)  # fmt: skip
    if paper:
        prep = _paper_margin(prep)
    res = backprop(model, kwargs=prep.inputs, output=prep.target, semirings=srs,
                   paper=bool(paper), weights=weights)  # fmt: skip
    value = float(res.values[res.graph.output_node])
    rows = prep.examples
    ex = Explanation(
        model_id, kind if task == "lm" else task, text, prep.target_name, prep.foil_name,
        rows[0], prep.position, value, res, task=task, text_pair=text_pair, what=prep.what,
        examples=rows,
    )  # fmt: skip
    ex.source = _embedding_path(model)
    ex.mask = _mask_of(prep.inputs, rows)
    ex.tokens, ex.pair_tokens = _tokens_of(ex, tokenizer, prep.inputs)
    ex.raw_tokens = [tokenizer.convert_ids_to_tokens(r) for r in prep.inputs["input_ids"].tolist()]
    layers = res.layer_table(tokens=rows if len(rows) > 1 else rows[0], by="role",
                             per_head=per_head)  # fmt: skip
    ex.layers = layers if ex.mask is None else _without_padding(layers, ex.mask)
    maxes = [s for s in srs if isinstance(s, MaxProduct)]
    ex.paper = bool(paper)
    ex.weights = weights
    if paper and maxes and len(layers):  # the paper's quantity, beside ours
        table = res.layer_table(semirings=maxes[:1], aggregate="paper",
                                tokens=rows if len(rows) > 1 else rows[0], by="role",
                                per_head=per_head)  # fmt: skip
        ex.paper_layers = table if ex.mask is None else _without_padding(table, ex.mask)
    if maxes:
        sources = [(ex.source, (e,)) for e in range(len(rows))] if len(rows) > 1 else [ex.source]
        ex.paths = [res.top_path(where, maxes[0]) for where in sources]
        ex.path = ex.paths[0]
    if Entropy() in srs:
        if len(rows) == 1:
            ex.entropy = _entropy_table(res, ex.source, rows[0])
        else:
            import pandas as pd

            frames = [_entropy_table(res, ex.source, r, e) for e, r in enumerate(rows)]
            ex.entropy = pd.concat(
                [f.assign(example=e) for e, f in enumerate(frames)], ignore_index=True
            )[["example", *frames[0].columns]]
        if ex.mask is not None:
            ex.entropy = _without_padding(ex.entropy, ex.mask).reset_index(drop=True)
    return ex


def _mask_of(inputs, rows) -> list | None:
    """The attention mask as one list of 0/1 per example, or None where every position
    of every example is a token."""
    m = inputs.get("attention_mask")
    if m is None or m.dim() != 2 or tuple(m.shape) != (len(rows), len(rows[0])):
        return None
    m = m.detach().cpu().long()
    return None if bool((m != 0).all()) else (m != 0).long().tolist()


def _without_padding(table, mask):
    from ..analysis.readouts import drop_padding
    from ..views.table import branch_table

    out = drop_padding(table, mask)
    if hasattr(table, "view"):  # a BranchTable stays one (with its mask, for its heatmap)
        out = branch_table(out.reset_index(drop=True))
        out.attrs["attention_mask"] = mask
    return out


def _tokens_of(ex, tokenizer, inputs) -> tuple[list, list | None]:
    """``(tokens, pair_tokens)``: similarity, each text's own tokens (padding left out);
    a sentence pair, the joint input's tokens and its second segment's."""
    if ex.text_pair is None:
        return ex.tokens, None
    if ex.task == "similarity" and ex.examples and len(ex.examples) == 2:
        return ex.real_tokens(0), ex.real_tokens(1)
    types = inputs.get("token_type_ids")
    if types is not None and bool((types[0] == 1).any()):
        return ex.tokens, [t for t, k in zip(ex.tokens, types[0].tolist()) if k == 1]
    try:
        seq = tokenizer(ex.text, ex.text_pair).sequence_ids(0)
    except (ValueError, AttributeError, TypeError):  # a slow tokenizer: no sequence ids
        return ex.tokens, None
    if len(seq) != len(ex.tokens):
        return ex.tokens, None
    return ex.tokens, [t for t, k in zip(ex.tokens, seq) if k == 1]


_KEPT = Kept(size=2)


def _load_kept(model_id, task, kind, dtype, device):
    """``(model, tokenizer, kind)`` for a checkpoint given by name: the one loaded by an
    earlier call when nothing it was loaded from has changed (so its trace and compiled
    kernels serve again), else loaded now and kept."""
    from . import tasks

    key = _KEPT.key(model_id, task if task != "lm" else "lm", kind, dtype, str(device))
    kept = _KEPT.get(key)
    if kept is not None:
        return kept
    if task == "lm":
        kept = load(model_id, kind, dtype, device)
    else:
        kept = (*tasks.load_task(model_id, task, dtype, device), kind)
    _KEPT.put(key, kept)
    return kept


def clear_loaded() -> None:
    """Forget the models ``explain`` keeps (the last two loaded by name), freeing
    their memory."""
    _KEPT.clear()


def _check_head(model, task: str) -> None:
    """A loaded model whose output is not what ``task`` reads is refused."""
    want = {"classification": "ForSequenceClassification", "token": "ForTokenClassification"}
    if task in want and want[task] not in type(model).__name__:
        raise InputError(
            f"the {task} task reads a {want[task][3:]} model's logits; "
            f"{type(model).__name__} is not one: load it with "
            f"AutoModel{want[task]}.from_pretrained"
        )


def _embedding_path(model) -> str:
    emb = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is emb)


def _entropy_table(res, source, tokens, example: int = 0):
    import pandas as pd

    h = res.aggregate(source, Entropy()).entropy[example]
    log_n = res.aggregate(source, PathCount()).log_count[example]
    norm = torch.where(log_n > 0, h / log_n, torch.zeros_like(h))
    return pd.DataFrame(
        {
            "token": range(len(tokens)),
            "token_text": tokens,
            "entropy": h.double().tolist(),
            "log_paths": log_n.double().tolist(),
            "normalized": norm.double().tolist(),
        }
    )
