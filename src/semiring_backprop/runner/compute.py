"""Examples to inputs, inputs to tables: one model, one trace, batches of equal length.

:func:`prepare` tokenizes an example (or says why it is skipped); :class:`Explainer`
explains a batch of prepared examples of one length in one pass (the examples of a
batch do not interact: each has its own row of the batch, and its own score is seeded)
and returns three tidy tables: ``examples`` (one row per example: score, top path),
``tokens`` (per example and token: each semiring's readout at the word embeddings, and
the entropies' means over the hidden units) and ``branches`` (per example, token, layer,
branch and aggregation over the hidden units: :meth:`Result.layer_table`).
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass

import torch

from .._files import json_safe
from ..data.agreement import MASK
from ..errors import ForwardError, InputError, NonFiniteError
from ..semirings import Entropy, LogAbs, MaxAbs, MaxProduct, PathCount, Real, TopK
from ..tokens import readable_tokens
from .readers import Example
from .store import TABLES


@dataclass
class Item:
    """A prepared example: token ids and what is explained."""

    example: Example
    ids: list
    position: int  #: the position whose prediction is explained
    target: int
    foil: int
    words: list  #: per token, the index of its whitespace word (-1: a special token)
    #: further masks of a word in pieces, ``(position, target, foil)`` each: the score is
    #: the sum over all masks (the first is ``position``, ``target``, ``foil``)
    masks: tuple = ()


def prepare(ex: Example, tokenizer, config, kind: str) -> Item | str:
    """The inputs of ``ex``, or the reason it is skipped (a text)."""
    from ..hf.loading import encode, word_id

    try:
        target, foil = word_id(tokenizer, ex.target, kind), word_id(tokenizer, ex.foil, kind)
    except InputError as e:
        return f"target/foil: {e}"
    if target == foil:
        return f"target {ex.target!r} and foil {ex.foil!r} are the same token"
    text = ex.text
    if MASK in text.split():
        if kind == "masked":
            text = " ".join(tokenizer.mask_token if w == MASK else w for w in text.split())
        else:  # a causal LM predicts the masked word from the words before it
            text = " ".join(text.split()[: text.split().index(MASK)])
    try:
        inputs, pos = encode(tokenizer, _stand_in(config), text, kind)
    except InputError as e:
        return str(e)
    ids = inputs["input_ids"][0].tolist()
    return Item(ex, ids, pos, target, foil, _word_of_tokens(tokenizer, text, len(ids)))


def _stand_in(config):
    """What :func:`~semiring_backprop.hf.loading.encode` reads of a model, from its config
    (a process that only tokenizes, such as a Ray driver, loads no weights)."""
    table = types.SimpleNamespace(num_embeddings=getattr(config, "vocab_size", None))
    return types.SimpleNamespace(config=config, device=torch.device("cpu"),
                                 get_input_embeddings=lambda: table)  # fmt: skip


def _word_of_tokens(tokenizer, text: str, n: int) -> list:
    """Per token, the index of the whitespace word it comes from (-1: none or unknown)."""
    if not getattr(tokenizer, "is_fast", False):
        return [-1] * n
    enc = tokenizer(text, return_offsets_mapping=True)
    starts, at = [], 0
    for w in text.split(" "):
        if w:
            starts.append(at)
        at += len(w) + 1
    import bisect

    out = []
    for a, b in enc["offset_mapping"]:
        out.append(-1 if a == b else bisect.bisect_right(starts, a) - 1)
    return out if len(out) == n else [-1] * n


class Score(torch.nn.Module):
    """``log p(target) - log p(foil)`` at ``position``, per example of a batch, summed
    over the example's masks (``position``, ``target``, ``foil``: ``(batch, masks)``);
    the positions and token ids are tensor inputs, so one trace serves every batch with
    as many masks.

    ``logits=True`` (paper mode) computes the same number as the difference of the two
    logits, as the paper's analysis did (``analyze_kvq.py``: ``logits[good] -
    logits[bad]``): that graph has no log-softmax, whose paths through the log-sum-exp
    reach every logit and change the max-product values."""

    def __init__(self, model, logits: bool = False):
        super().__init__()
        self.model, self.logits = model, logits

    def forward(self, input_ids, attention_mask, position, target, foil):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        at = position[:, :, None].expand(-1, -1, logits.shape[-1])
        logp = logits.gather(1, at)  # (batch, masks, vocab)
        if not self.logits:
            logp = logp.log_softmax(-1)
        diff = logp.gather(2, target[:, :, None]) - logp.gather(2, foil[:, :, None])
        return diff[:, :, 0].sum(1)


def inputs(items: list[Item], device) -> dict:
    ids = torch.tensor([it.ids for it in items], dtype=torch.long, device=device)
    col = lambda k: torch.tensor([[m[k] for m in _masks(it)] for it in items], device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "position": col(0), "target": col(1), "foil": col(2)}  # fmt: skip


def _masks(item: Item) -> list:
    """``(position, target, foil)`` of every mask of ``item``, the first one first."""
    return [(item.position, item.target, item.foil), *item.masks]


class Explainer:
    """One model, one :class:`~semiring_backprop.Backprop` (one trace for all lengths).
    ``paper``: paper mode (the paper's graph; the score as the difference of the logits,
    see :class:`Score`); ``logits``: that score on our own graph; ``branches=False``: the
    branches table left empty (its columns only)."""

    def __init__(self, model, tokenizer, semirings: list, top_path: bool = False,
                 pairs: bool = True, aggregation=("oplus",), paper: bool = False,
                 logits: bool = False, branches: bool = True):  # fmt: skip
        from .._backprop import Backprop

        self.model, self.tokenizer = model.eval(), tokenizer
        self.aggregation = tuple(aggregation)
        self.wrapper = Score(self.model, logits=paper or logits).eval()
        self.branches = branches
        self.semirings, self.top_path, self.pairs = list(semirings), top_path, pairs
        self.bp = Backprop(self.wrapper, output=lambda y: y, semirings=self.semirings,
                           per_example=True, paper=paper, dynamic=True)  # fmt: skip
        emb = self.model.get_input_embeddings()
        self.source = next(n for n, m in self.wrapper.named_modules() if m is emb)

    def __call__(self, items: list[Item]) -> dict:
        """The three tables of a batch of items of one length (pandas DataFrames).

        With ``pairs`` (default), a batch of one runs as two copies of its example: a
        trace of a batch of one serves only batches of one, so the first single batch
        would trace the model again; the copy's rows are dropped."""
        import pandas as pd

        run = items * 2 if self.pairs and len(items) == 1 else items
        res = self.bp(kwargs=inputs(run, self.model.device))
        scores = res.values[res.graph.output_node].detach().double().cpu().tolist()
        examples = pd.DataFrame([_example_row(it, s) for it, s in zip(items, scores)])
        tokens = self._tokens(res, items)
        branches = self._branches(res, items) if self.branches else pd.DataFrame(
            columns=BRANCH_COLUMNS)  # fmt: skip
        if self.top_path:
            top = next(s for s in self.semirings if isinstance(s, MaxProduct | MaxAbs | TopK))
            paths = [res.top_path((self.source, (b,)), top) for b in range(len(items))]
            examples["top_path_value"] = [float(p.value) for p in paths]
            examples["top_path"] = [str(p) for p in paths]
            examples["top_path_steps"] = [
                json.dumps(json_safe(p.to_dict(), "name", plain=False)) for p in paths
            ]
        return {"examples": examples, "tokens": tokens, "branches": branches}

    def _tokens(self, res, items):
        import pandas as pd

        cols = {}
        for sr in self.semirings:
            for name, value in readouts(res, self.source, sr).items():
                cols[name] = value.detach().double().cpu()  # (batch, tokens)
        if "entropy" in cols and "log_paths" in cols:
            h, n = cols["entropy"], cols["log_paths"]
            cols["normalized_entropy"] = torch.where(n > 0, h / n, torch.zeros_like(h))
            cols.update(unit_means(res, self.source))
        rows = []
        for b, it in enumerate(items):
            raw = self.tokenizer.convert_ids_to_tokens(it.ids)
            text = readable_tokens(raw, self.tokenizer)  # ' Mary'; token_raw: 'ĠMary'
            groups = _groups(it)
            for t in range(len(it.ids)):
                row = {"example_id": it.example.id, "token": t, "token_text": text[t],
                       "token_raw": raw[t], "word": it.words[t],
                       "group": groups.get(it.words[t], "")}  # fmt: skip
                row.update({k: float(v[b, t]) for k, v in cols.items()})
                rows.append(row)
        return pd.DataFrame(rows)

    def _branches(self, res, items):
        # the branches' contributions computed once, read by every aggregation
        table = res.layer_table(semirings=list(self.semirings),
                                aggregate=tuple(self.aggregation), by="role")  # fmt: skip
        if "example" not in table.columns:  # a batch of one
            table.insert(0, "example", 0)
        table = table[table["example"] < len(items)].reset_index(drop=True)
        ids = [it.example.id for it in items]
        raws = [self.tokenizer.convert_ids_to_tokens(it.ids) for it in items]
        texts = [readable_tokens(r, self.tokenizer) for r in raws]
        keys = list(zip(table["example"], table["token"]))
        table["token_text"] = [texts[e][t] for e, t in keys]
        table.insert(table.columns.get_loc("token_text") + 1, "token_raw",
                     [raws[e][t] for e, t in keys])  # fmt: skip
        table.insert(0, "example_id", [ids[e] for e in table["example"]])
        return table.drop(columns=["example", "consumer"])


#: the columns of the branches table (what an empty one holds)
BRANCH_COLUMNS = ["example_id", "layer", "sublayer", "token", "token_text", "token_raw",
                  "branch", "value", "winner", "path", "semiring", "aggregation"]  # fmt: skip


def readouts(res, source: str, sr) -> dict:
    """Per token (``(batch, tokens)``), the ⊕ of ``sr`` over the hidden units at
    ``source`` (Eq. 3), by name: ``real`` (the gradient summed; and ``real_l2``, its
    Euclidean norm over the hidden units), ``max_hi`` /
    ``max_lo``, ``entropy`` / ``log_z``, ``log_paths``, ``maxabs_log``, ``logabs_log``,
    ``topk_1``...; ``max_tensor_hi`` for the tensor granularity."""
    if isinstance(sr, Real):  # the sum is ~0 wherever a layer norm reads the embeddings
        g = res.at(source, sr)  # (it ignores a shift of all units): the norm says more
        return {"real": res.aggregate(source, sr), "real_l2": g.norm(dim=-1)}
    r = res.aggregate(source, sr)
    if isinstance(sr, MaxProduct):
        tag = "max" if sr.granularity == "neuron" else "max_tensor"
        return {f"{tag}_hi": r.hi, f"{tag}_lo": r.lo}
    if isinstance(sr, Entropy):
        return {"entropy": r.entropy, "log_z": r.log_z}
    if isinstance(sr, PathCount):
        return {"log_paths": r.log_count}
    if isinstance(sr, MaxAbs):
        return {"maxabs_log": r.log}
    if isinstance(sr, LogAbs):
        return {"logabs_log": r.log}
    if isinstance(sr, TopK):
        return {f"topk_{i + 1}": r.values[..., i] for i in range(sr.k)}
    raise InputError(f"no per-token readout for {sr}")


def unit_means(res, source: str) -> dict:
    """Per token (``(batch, tokens)``), the means over the hidden units at ``source`` of
    the path entropy of each unit, of its ``log #paths`` and of their ratio (0 where a
    unit has one path): the paper's per-element entropies, where the ``entropy`` column
    is the entropy of all of the token's paths together (⊕ over the units)."""
    h = res.at(source, Entropy()).entropy.double()
    n = res.at(source, PathCount()).log_count.double()
    norm = torch.where(n > 0, h / n, torch.zeros_like(h))
    return {"entropy_unit_mean": h.mean(-1).cpu(), "log_paths_unit_mean": n.mean(-1).cpu(),
            "normalized_entropy_unit_mean": norm.mean(-1).cpu()}  # fmt: skip


def _groups(item: Item) -> dict:
    """word index -> the comma-joined names of the positions of interest holding it."""
    out: dict = {}
    for name, idx in item.example.positions.items():
        for w in idx:
            out[w] = f"{out[w]},{name}" if w in out else name
    return out


def _example_row(it: Item, score: float) -> dict:
    ex = it.example
    row = {"example_id": ex.id, "source": ex.source, "text": ex.text, "target": ex.target,
           "foil": ex.foil, "tokens": len(it.ids), "position": it.position,
           "target_id": it.target, "foil_id": it.foil, "score": score,
           "masks": json.dumps([list(m) for m in _masks(it)]),
           "positions": json.dumps({k: list(v) for k, v in ex.positions.items()})}  # fmt: skip
    for k, v in ex.extra.items():
        row[k if k not in row else f"extra_{k}"] = v
    return row


def explain_batch(explainer: Explainer, group: list[Item]) -> dict:
    """The tables of a batch; where the batch fails in the forward pass or overflows,
    its examples one by one, and those that fail alone are skipped with the reason."""
    try:
        return explainer(group)
    except (ForwardError, NonFiniteError) as e:
        if len(group) == 1:
            return {"skipped": {group[0].example.id: f"{type(e).__name__}: {e}"}}
    parts = [explain_batch(explainer, [it]) for it in group]
    merged: dict = {"skipped": {}}
    import pandas as pd

    for name in TABLES:
        frames = [p[name] for p in parts if name in p]
        if frames:
            merged[name] = pd.concat(frames, ignore_index=True)
    for p in parts:
        merged["skipped"].update(p.get("skipped", {}))
    return merged
