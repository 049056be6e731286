"""Explain a whole data set: readers -> batches -> explain -> Parquet shards, resumable.

Results are written as they are computed: each batch's three tables become one Parquet
file each (``examples/``, ``tokens/``, ``branches/``, under one shard name), written
under a temporary name and renamed; then the shard's line in ``done.jsonl`` commits it,
with each example's content key and each file's size and hash (:mod:`.store`). A rerun
checks the directory against the data and itself (:func:`.store.check`: examples that
changed, shards damaged, shards never committed), and explains only the examples no
line holds: no row is lost, written twice, or kept under an id whose example is now
another. A rerun with other settings, or into a directory of results without its
``config.json``, is refused
(:func:`~semiring_backprop.runner.records.same_settings`). A disk that fills up
stops the run with one error that says what was kept; the rerun resumes.

``paper=True`` computes the paper's quantity (DESIGN §1, paper mode): the model traced as
the paper's library (brunoflow) built its graph, at tensor granularity, the score as the
paper's analysis took it (the difference of the two logits: the same number, without the
log-softmax's paths), and the branch tables aggregated as the paper did
(``aggregation="paper"``: per token, the best hidden unit's value goes to the branch that
wins it, every other branch gets 0).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError
from . import store
from .compute import Explainer, Item, explain_batch, prepare
from .readers import iter_examples, read_examples, split_rows
from .records import Records, atomic_write, lock, same_settings

log = logging.getLogger(__name__)

TABLES = store.TABLES
DEFAULT_SEMIRINGS = ("max", "entropy", "real")
#: how a branch's value is read over the hidden units (:meth:`Result.layer_table`);
#: "paper" only with ``paper=True`` (on another trace it is not the paper's quantity)
AGGREGATIONS = ("oplus", "bucket_sum", "paper")
#: settings that choose how (or how much) is computed, not what: a rerun may change them
FREE = ("limit", "batch_size", "workers", "threads")


@dataclass(frozen=True)
class Settings:
    """What a run's results depend on (``config.json`` of its output directory)."""

    model: str
    data: str | None
    format: str = "auto"
    columns: tuple = ()
    split: str | None = None
    semirings: tuple = DEFAULT_SEMIRINGS
    granularity: str = "neuron"
    kind: str | None = None
    dtype: str = "float32"
    top_path: bool = False
    aggregation: tuple = ("oplus",)
    paper: bool = False  #: paper mode: the paper's graph, score and aggregation
    #: the score read as the margin of the two logits (the same number as the difference
    #: of the log-probabilities, without the log-softmax's paths); paper mode reads it so
    logits: bool = False
    branches: bool = True  #: the branches table (False: examples and tokens only)
    limit: int | None = None
    batch_size: int = 8
    workers: int = 0
    threads: int = 0

    def check(self) -> None:
        from ..hf.explain import semirings_for

        semirings_for(self.semirings, self.granularity)
        if self.granularity not in ("neuron", "tensor"):
            raise InputError(f"granularity must be 'neuron' or 'tensor', got {self.granularity!r}")
        if self.dtype not in ("float32", "float64"):
            raise InputError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.kind not in (None, "masked", "causal"):
            raise InputError(f"kind must be 'masked' or 'causal', got {self.kind!r}")
        for name, low in (("batch_size", 1), ("workers", 0), ("threads", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise InputError(f"{name} must be a whole number >= {low}, got {v!r}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise InputError(f"limit must be a positive whole number or None, got {self.limit!r}")
        selective = {"max", "maxabs", "topk"} & set(self.semirings)
        if self.top_path and not selective:
            raise InputError("top_path needs a semiring with back-pointers: add 'max'")
        bad = [a for a in self.aggregation if a not in AGGREGATIONS]
        if bad or not self.aggregation or len(set(self.aggregation)) < len(self.aggregation):
            raise InputError(
                f"aggregation must be some of {', '.join(AGGREGATIONS)} (each once), got "
                f"{self.aggregation!r}"
            )
        if "bucket_sum" in self.aggregation and not selective:
            raise InputError(
                "aggregation 'bucket_sum' assigns each hidden unit to the branch its ⊕ "
                "selects: add a selective semiring ('max', 'maxabs' or 'topk')"
            )
        self._check_paper(selective)

    def _check_paper(self, selective) -> None:
        for name in ("paper", "logits", "branches"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.paper and self.granularity != "tensor":
            raise InputError(
                "paper=True computes what the paper's library (brunoflow) did, at tensor "
                f"granularity; granularity={self.granularity!r} contradicts it: pass "
                "granularity='tensor' (or leave it out), or drop paper=True"
            )
        if "paper" in self.aggregation and not self.paper:
            raise InputError(
                "aggregation 'paper' is the paper's winner-take-all reading of brunoflow's "
                "values; on a trace that is not paper mode it would be another quantity under "
                "the paper's name: pass paper=True (granularity 'tensor'), or choose 'oplus' "
                "or 'bucket_sum'"
            )
        if "paper" in self.aggregation and not selective:
            raise InputError(
                "aggregation 'paper' gives each token's best hidden unit to the branch that "
                "wins it: add the semiring 'max' (the paper's)"
            )


def run(model, data=None, out="runs/data", *, examples: Iterable | None = None,
        tokenizer=None, semirings=DEFAULT_SEMIRINGS, granularity: str | None = None,
        kind: str | None = None, dtype: str = "float32", device="cpu", format: str = "auto",
        columns: dict | None = None, split: str | None = None, top_path: bool = False,
        aggregation=None, paper: bool = False, batch_size: int = 8, limit: int | None = None,
        workers: int = 0, address: str | None = None, threads: int = 0, figures: bool = True,
        progress: bool = True, prepare=prepare, gguf_file: str | None = None,
        logits: bool = False, branches: bool = True) -> dict:  # fmt: skip
    """Explain ``log p(target) - log p(foil)`` for every example of ``data`` (a file, a
    saved Hugging Face data set, a data set name) or of ``examples`` (an iterable of
    ``semiring_backprop.runner.Example`` objects or dicts with ``text``, ``target``,
    ``foil`` and more columns, copied to the results: how an experiment adds its own
    columns).

    ``model``: a hub id or a local directory (a masked or causal LM), or a loaded model
    (then pass ``tokenizer``). Writes into ``out``: ``examples/``, ``tokens/`` and
    ``branches/`` (Parquet shards, read back with
    [load_results][semiring_backprop.load_results]), ``done.jsonl``,
    ``summary.json`` and figures. ``workers``: that many Ray actors (each one model,
    one trace, a fair share of the cores); ``address`` joins a running Ray cluster.
    ``threads``: torch threads of a one-process run (0: the caller's count).
    ``aggregation``: how the ``branches`` table reads a branch over the hidden units,
    ``"oplus"`` (the semiring's ⊕) and/or ``"bucket_sum"`` (each unit counted for the
    branch ⊕ selects there; selective semirings only): its ``aggregation`` column
    (default ``"oplus"``).
    ``paper=True``: the paper's quantity (paper mode, see the module's docstring):
    granularity ``"tensor"`` (its default; ``"neuron"`` is refused) and aggregation
    ``"paper"`` by default (which is refused without ``paper``).
    ``logits=True``: the score read as ``logit(target) - logit(foil)`` (the same number,
    without the log-softmax's paths, whose normalizer reaches every logit; paper mode
    always reads it so). ``branches=False``: no branch table (its shards hold no rows),
    for runs that read the tokens' values only: the table is most of a pass's time.
    ``prepare``: how an example becomes an ``Item`` or the reason it is skipped
    (``prepare(example, tokenizer, model_config, kind) -> Item | str``; default
    ``semiring_backprop.runner.prepare``): how an experiment tokenizes its own way
    or scores a word in pieces (``Item.masks``). It runs in this process; its items
    go to the workers.

    The runnable example is on the API page (it needs a checkpoint); with a real one:
    ``run("bert-base-uncased", "regular_plural_subject_verb_agreement_1.jsonl",
    "runs/blimp", semirings=("max", "entropy"))``, then
    ``load_results("runs/blimp")["branches"]``.
    """
    if isinstance(model, str | Path):
        from ..hf.gguf import checkpoint

        model = checkpoint(model, gguf_file)
    model_id = model if isinstance(model, str | Path) else getattr(
        getattr(model, "config", None), "_name_or_path", "") or type(model).__name__  # fmt: skip
    if examples is not None and data is not None:
        raise InputError("pass data= (a file or data set) or examples= (an iterable), not both")
    if examples is None and data is None:
        raise InputError("no data: pass data= (a file or data set) or examples=")
    if granularity is None:
        granularity = "tensor" if paper else "neuron"
    if aggregation is None:
        aggregation = ("paper",) if paper else ("oplus",)
    settings = Settings(
        model=_where(model_id), data=None if data is None else _where(data), format=format,
        columns=tuple(sorted((columns or {}).items())), split=split,
        semirings=(semirings,) if isinstance(semirings, str) else tuple(semirings),
        granularity=granularity, kind=kind, dtype=dtype,
        top_path=top_path, aggregation=_names(aggregation), paper=paper, logits=logits,
        branches=branches, limit=limit,
        batch_size=batch_size, workers=workers,
        threads=threads,
    )  # fmt: skip
    settings.check()
    if workers:
        from .workers import require_ray

        require_ray()
        if not isinstance(model, str | Path):
            raise InputError("workers= loads the model in each worker: pass a hub id or directory")
    if isinstance(model, str | Path):
        from ..hf.loading import check_device

        check_device(device)
    elif tokenizer is None:
        raise InputError("pass tokenizer= with a loaded model (or give a hub id / directory)")
    else:
        have = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        if have is not None and have != getattr(torch, dtype):
            raise InputError(
                f"the model's weights are {have}, and dtype={dtype!r}: convert the model "
                "(model.double() / model.float()) or pass its dtype"
            )
    if data is not None:
        every, malformed = read_examples(data, format, columns, split)
    else:
        every, malformed = split_rows(iter_examples(examples))
    for m in malformed:
        log.warning("%s: skipped: %s", m.source, m.reason)
    if not every:
        raise InputError(
            f"{data if data is not None else 'examples'}: no examples could be read "
            f"({len(malformed)} malformed rows" + (f", first: {malformed[0].source}: "
            f"{malformed[0].reason})" if malformed else ")")
        )  # fmt: skip
    chosen = every[:limit]
    out = Path(out)
    started = time.perf_counter()
    with lock(out):
        records = None
        try:
            same_settings(out, settings, free=FREE)
            records = Records(out / "done.jsonl", key="shard")
            done = store.check(out, records, every)
            todo = [ex for ex in chosen if ex.id not in done]
            n_new = 0
            if todo:
                source = _Source(model, tokenizer, settings, device)
                n_new = _explain(todo, source, records, out, settings, address, progress,
                                 prepare)  # fmt: skip
            elapsed = time.perf_counter() - started
            from .report import summarize

            return summarize(out, settings, chosen, malformed, records, n_new, elapsed,
                             figures)  # fmt: skip
        except OSError as e:
            if not store.full(e):
                raise
            raise _disk_full(out, e, records, chosen) from None


def _names(value) -> tuple:
    """A name or names as a tuple (``"oplus"`` is ``("oplus",)``, not five letters)."""
    return (value,) if isinstance(value, str) else tuple(value)


def _where(name) -> str:
    """A local path as an absolute one (a rerun from another directory is the same
    run); a hub or data set name as given."""
    p = Path(str(name)).expanduser()
    return str(p.resolve()) if p.exists() else str(name)


class _Source:
    """The model, loaded once where it runs: here for one process, in every worker
    for Ray (then this process loads only the tokenizer and config)."""

    def __init__(self, model, tokenizer, settings: Settings, device):
        self.settings, self.device = settings, device
        self.model, self.tokenizer, self.kind = model, tokenizer, settings.kind
        self.config = getattr(model, "config", None)
        if isinstance(model, str | Path):
            self.model = str(model)
            if settings.workers:
                self.tokenizer, self.config, self.kind = load_tokenizer(self.model, settings.kind)
            else:
                from ..hf.loading import load

                m, self.tokenizer, self.kind = load(
                    self.model, settings.kind, getattr(torch, settings.dtype), device
                )
                self.model, self.config = m, m.config
        elif self.kind is None:
            from ..hf.loading import lm_kind

            self.kind = lm_kind(model.config, tokenizer, type(model).__name__)

    def explainer(self) -> Explainer:
        from ..hf.explain import semirings_for

        srs = semirings_for(self.settings.semirings, self.settings.granularity)
        return Explainer(self.model, self.tokenizer, srs, self.settings.top_path,
                         pairs=self.settings.batch_size > 1,
                         aggregation=self.settings.aggregation,
                         paper=self.settings.paper, logits=self.settings.logits,
                         branches=self.settings.branches)  # fmt: skip


def load_tokenizer(model_id: str, kind=None):
    """``(tokenizer, config, kind)`` without the weights."""

    from ..hf.loading import check_local, config_and_tokenizer, lm_kind

    check_local(model_id)
    config, tok = config_and_tokenizer(model_id)
    return tok, config, kind or lm_kind(config, tok)


def batches(items: list[Item], size: int) -> list[list[Item]]:
    """Items of equal token length and number of masks together (no padding: the
    examples of a batch do not interact), in the order of their first example, at most
    ``size`` each."""
    by_length: dict = {}
    for it in items:
        by_length.setdefault((len(it.ids), len(it.masks)), []).append(it)
    out = []
    for group in by_length.values():
        out += [group[i : i + size] for i in range(0, len(group), size)]
    return out


def _explain(todo, source: _Source, records, out: Path, settings, address, progress,
             prepare=prepare) -> int:  # fmt: skip
    from tqdm.auto import tqdm

    items, skipped = [], {}
    for ex in todo:
        got = prepare(ex, source.tokenizer, source.config, source.kind)
        if isinstance(got, str):
            log.warning("%s: skipped: %s", ex.source, got)
            skipped[ex.id] = got
        elif isinstance(got, Item):
            items.append(got)
        else:
            raise InputError(
                f"prepare= gave a {type(got).__name__} for example {ex.id!r} ({ex.source}): "
                "it must return a runner.Item, or the reason the example is skipped (a str)"
            )
    if skipped:
        keys = {ex.id: store.content_key(ex) for ex in todo if ex.id in skipped}
        records.add({"shard": None, "ids": [], "skipped": skipped, "keys": keys})
    groups = batches(items, settings.batch_size)
    bar = tqdm(total=len(items), desc="examples", unit="ex", disable=not progress, leave=False)
    n = 0
    try:
        if settings.workers:
            from .workers import ray_batches

            results = ray_batches(groups, source, settings.workers, address)
        else:
            from .._threads import threads

            results = _serial(groups, source, threads(settings.threads))
        for group, tables in results:
            _commit(out, records, group, tables)
            n += len(group)
            bar.update(len(group))
    finally:
        bar.close()
    return n


def _serial(groups, source: _Source, thread_count):
    with thread_count:
        explainer = source.explainer()
        for group in groups:
            yield group, explain_batch(explainer, group)


def _commit(out: Path, records: Records, group: list[Item], tables: dict) -> None:
    """Write a batch's shards, then the line in ``done.jsonl`` that commits them (with
    each example's content key, and each file's size and hash)."""
    skipped = tables.get("skipped", {})
    for where, reason in skipped.items():
        log.warning("example %s: skipped: %s", where, reason)
    ids = [it.example.id for it in group if it.example.id not in skipped]
    keys = {it.example.id: store.content_key(it.example) for it in group}
    name, files = None, {}
    if ids:
        name = f"{len(records.rows):06d}-{uuid.uuid4().hex[:8]}"
        for table in TABLES:
            frame = tables[table]
            path = out / table / f"{name}.parquet"
            atomic_write(path, lambda tmp, f=frame: f.to_parquet(tmp, index=False))
            files[table] = store.file_record(path)
    records.add({"shard": name, "ids": ids, "skipped": skipped, "keys": keys, "files": files})


def _disk_full(out: Path, e: OSError, records, chosen) -> InputError:
    """One error for a full disk: what was kept, and that the rerun resumes."""
    what = f" while writing {e.filename}" if getattr(e, "filename", None) else ""
    if records is None:
        kept = "nothing was explained yet"
    else:
        done = store.current(records.rows, records.path)
        n = sum(1 for ex in chosen if ex.id in done)
        kept = (
            f"{n} of the {len(chosen)} examples are committed in {out / 'done.jsonl'} and "
            "kept (a file cut off by the full disk is not: it was never committed)"
        )
    return InputError(
        f"the disk is full ({e.strerror or e}){what}, in the run into {out}: {kept}. Free "
        "some space (or write into a directory on another disk) and run the same command "
        "again: it resumes with the examples left"
    )


def skipped_examples(out) -> dict:
    """``{example id: reason}`` for the examples a run in ``out`` skipped (committed in
    its ``done.jsonl``: the reasons of :func:`load_results`' missing examples)."""
    out = Path(out)
    if not (out / "done.jsonl").exists():
        raise InputError(f"{out} holds no run (no done.jsonl): run semiring-backprop run first")
    records = Records(out / "done.jsonl", key="shard")
    return {i: d.skipped for i, d in store.current(records.rows, records.path).items()
            if d.skipped is not None}  # fmt: skip
