"""Ray actors: each holds one model, one trace and a fair share of the cores.

The driver (the calling process) reads, tokenizes and batches the data, and writes every
result; actors only explain batches. A batch is explained the same way wherever it
runs, so the tables equal those of a one-process run with the same thread count per
process (another thread count may change the last bits of float sums).
"""

from __future__ import annotations

import logging
import os

from ..errors import InputError, SemiringBackpropError

INSTALL = (
    "workers= (--workers) runs Ray actors, and Ray is not installed: pip install "
    '"semiring-backprop[ray]" (or leave workers at 0 for one process)'
)
#: the object store of a local cluster started here (batches and tables are small)
OBJECT_STORE = 200 * 2**20


class Worker:
    """One model and one :class:`~semiring_backprop.Backprop`, on ``threads`` threads."""

    def __init__(self, model_id: str, settings, device, threads: int):
        import torch

        from ..hf.explain import semirings_for
        from ..hf.loading import load
        from .compute import Explainer

        torch.set_num_threads(threads)  # this process's own count, for its whole life
        model, tokenizer, _ = load(model_id, settings.kind, getattr(torch, settings.dtype), device)
        srs = semirings_for(settings.semirings, settings.granularity)
        self.explainer = Explainer(model, tokenizer, srs, settings.top_path,
                                   pairs=settings.batch_size > 1,
                                   aggregation=settings.aggregation,
                                   paper=getattr(settings, "paper", False),
                                   logits=getattr(settings, "logits", False),
                                   branches=getattr(settings, "branches", True))  # fmt: skip

    def explain(self, job):
        """``job``: (batch number, items); the tables carry the number back."""
        from .compute import explain_batch

        number, group = job
        return {**explain_batch(self.explainer, group), "_batch": number}


def require_ray():
    """The ``ray`` module, or an :class:`InputError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise InputError(INSTALL) from None
    return ray


def ray_batches(groups, source, workers: int, address: str | None = None):
    """``(batch, tables)`` for every batch, as the actors finish them."""
    ray = require_ray()
    from ray.util import ActorPool

    started = not ray.is_initialized()
    if started:
        options = {"include_dashboard": False, "log_to_driver": False,
                   "logging_level": logging.ERROR, "configure_logging": False}  # fmt: skip
        try:
            if address:
                ray.init(address=address, **options)
            else:
                ray.init(num_cpus=os.cpu_count() or workers,
                         object_store_memory=OBJECT_STORE, **options)  # fmt: skip
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = f"the Ray cluster at {address!r}" if address else "a local Ray cluster"
            raise InputError(f"could not start or join {where}: {e}") from None
    actors = []
    try:
        cpus = int(ray.available_resources().get("CPU", workers))
        # an actor runs on one node: its share is at most the largest node's CPUs
        node = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")),
                   default=cpus)  # fmt: skip
        share = max(1, min(cpus // workers, int(node)))
        if cpus < workers:
            raise InputError(
                f"workers={workers}, but the Ray cluster has {cpus} free CPUs: use at most "
                f"{max(cpus, 1)} workers"
            )
        actor = ray.remote(num_cpus=share)(Worker)
        s = source.settings
        actors = [actor.remote(source.model, s, source.device, share) for _ in range(workers)]
        pool = ActorPool(actors)
        for job in enumerate(groups):
            pool.submit(lambda a, v: a.explain.remote(v), job)
        pending = dict(enumerate(groups))  # results come back in any order
        while pool.has_next():
            try:
                tables = pool.get_next_unordered()
            except ray.exceptions.RayTaskError as e:
                raise e.as_instanceof_cause() from None
            except ray.exceptions.RayError as e:  # a worker died (out of memory, killed)
                first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                raise SemiringBackpropError(
                    f"a Ray worker stopped ({type(e).__name__}: {first}); the results "
                    "written so far are kept: run again into the same output directory "
                    "to go on (with fewer workers if they ran out of memory)"
                ) from None
            yield pending.pop(tables.pop("_batch")), tables
    finally:
        for a in actors:
            ray.kill(a)
        if started:
            ray.shutdown()
