"""Memory a reverse pass needs at least, against what the machine has free.

Three semirings over a long input can need many times autograd's memory, and a process
past its memory limit is killed by the system without a word. So before the reverse pass
its need is estimated from the forward values it runs on: every D is a tensor of its
node's shape with each semiring's fields (``Semiring.zero`` of one element tells their
bytes); it exists from the first consumer's rule (in reverse order) until its node's own
rule has run, or to the end where the pass keeps it. The peak of that sum over the pass
is a lower bound (rules' temporaries come on top). When it exceeds the memory free now
(the system's available memory and the cgroup's limit, or the CUDA device's free
memory), the pass is refused with the estimate and what uses less.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import rules
from ..errors import InputError, OutOfMemoryError
from .reverse import reverse_plan

#: refuse only past this share of the free memory (the estimate is a lower bound)
SHARE = 1.0


def element_bytes(semirings, like: torch.Tensor) -> int:
    """Bytes of one element's D over all ``semirings`` (every field, pointers included)."""
    total = 0
    for sr in semirings:
        for f in sr.zero((1,), like):
            total += f.element_size()
    return total


def reverse_peak(graph, values: dict, semirings, needed, keep) -> int:
    """The largest sum of D bytes alive at once during the reverse pass (see module)."""
    ids, plan = graph.ids, reverse_plan(graph, needed)
    events: dict = {}  # node id -> bytes added (D made) and removed (D let go) there
    per_dtype: dict = {}
    for v in needed:
        val = values.get(v)
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        users = [ids[u] for u in v.users if u in needed]
        if not users and v is not graph.output_node:
            continue
        if len(users) == 1 and _moved(graph.nodes[users[0]], val, values, plan, ids):
            continue  # D is its consumer's, moved (a view): the same memory
        key = (val.dtype, val.device)
        if key not in per_dtype:
            per_dtype[key] = element_bytes(semirings, val)
        size = val.numel() * per_dtype[key]
        born = max(users) if users else ids[v]
        events[born] = events.get(born, 0) + size
        if keep is not None and v not in keep:  # let go once its rule has run
            events[ids[v] - 1] = events.get(ids[v] - 1, 0) - size
    live = peak = 0
    for t in sorted(events, reverse=True):  # the reverse pass visits ids downwards
        live += events[t]
        peak = max(peak, live)
    return peak


def _moved(user, val, values, plan, ids) -> bool:
    """Whether ``user``'s rule likely gives its input's D as a view of its own: a
    reshape, or a routing op of as many elements (a select on a size-1 dim, a slice of
    a whole dim, a permute). Counting such a D once keeps the estimate a lower bound."""
    if plan[ids[user]][1]:
        return True
    rule = rules.lookup(user.target) if user.op == "call_function" else None
    out = values.get(user)
    return (
        rule is not None and rule.kind == "routing" and isinstance(out, torch.Tensor)
        and out.numel() == val.numel()
    )  # fmt: skip


def available(device: torch.device) -> int | None:
    """Bytes that can be allocated now on ``device`` (None: unknown);
    ``SEMIRING_BACKPROP_MEMORY`` (bytes) sets it instead."""
    own = os.environ.get("SEMIRING_BACKPROP_MEMORY", "").strip()
    if own:
        try:
            budget = int(float(own))
        except (ValueError, OverflowError):  # a word, or inf / nan
            budget = -1
        if budget < 0:  # a setting, not memory: an InputError (not taken for an allocation)
            raise InputError(
                f"SEMIRING_BACKPROP_MEMORY={own!r}: expected a number of bytes, 0 or more "
                "(e.g. 4e9), or unset it to use the free memory the system reports"
            )
        return budget
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached
    if device.type != "cpu":
        return None
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:  # cgroup v2: the limit of this process's group, less what it uses
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check(graph, values: dict, semirings, needed, keep) -> None:
    """Refuse a reverse pass that cannot fit (see module). The estimate is kept per
    graph for the inputs' shapes (every node's size follows from them)."""
    out = values.get(graph.output_node)
    device = out.device if isinstance(out, torch.Tensor) else torch.device("cpu")
    free = available(device)
    if free is None:
        return
    shapes = tuple(
        (k, tuple(values[n].shape)) for k, n in graph.user_inputs.items()
        if isinstance(values.get(n), torch.Tensor)
    )  # fmt: skip
    cache = graph.__dict__.setdefault("_reverse_peak", {})
    key = (needed, None if keep is None else frozenset(keep), tuple(semirings), shapes)
    if key not in cache:
        if len(cache) > 64:  # many lengths: keep the newest
            cache.pop(next(iter(cache)))
        cache[key] = reverse_peak(graph, values, semirings, needed, keep)
    need = cache[key]
    if need <= SHARE * free:
        return
    names = ", ".join(s.name for s in semirings)
    raise refusal(need, free, device, names, keep is None or len(keep) > 8)


def refusal(need: int, free: int, device, names: str, suggest_keep: bool) -> OutOfMemoryError:
    """The error for a pass that cannot fit; ``.budget`` holds the arguments, so a caller
    that knows better whether ``keep=`` would help (checkpointed passes keep the inputs
    on their own) can write it again."""
    gib = 2**30
    e = OutOfMemoryError(
        f"the reverse pass needs at least {need / gib:.2f} GiB for its D values "
        f"({names}), and {free / gib:.2f} GiB is free on {device} (a process past its "
        f"limit is killed without a word). {what_uses_less(suggest_keep)} "
        "SEMIRING_BACKPROP_MEMORY=BYTES sets the budget."
    )
    e.budget = (need, free, device, names)
    return e


def what_uses_less(suggest_keep: bool) -> str:
    """The options that make a pass need less memory (``suggest_keep``: keep= too)."""
    keep = (
        " keep=('inputs_embeds',) (or the places you read) to hold only those readouts"
        " (paths and tables need keep=None);" if suggest_keep else ""
    )  # fmt: skip
    return (
        f"What uses less:{keep} fewer semirings per pass (TopK holds 3k fields per "
        "element); float32 instead of float64; a shorter input or a smaller batch."
    )
