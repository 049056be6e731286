"""The pass on a GPU run from Python and captured as one CUDA graph, against autograd.

The capture here is done by hand, outside the library: a ``keep=`` pass (forward values,
then the reverse pass with its overflow checks off) warmed up once on a side stream,
captured with ``torch.cuda.graph`` and replayed on a new input; the replay's values are
compared with a pass run from Python on that input ("relerr": the largest difference
over the largest value). ``semiring_backprop.engine.graphed`` is this mechanism inside
``Backprop`` (``cuda_graphs=True``). Encoders without their heads (BERT 6L-512, GPT-2
small; the explained scalar is 8 hidden units of the last position), one trace per
model shared by every set and length; times are medians of 5 calls, ratios to
torch's forward + backward to the input embeddings. The memory column of a replay is
not a measurement: the graph's pool is allocated at capture, so a replay allocates
nothing.

    python benchmarks/probe_cuda_graphs.py bert:20 bert:128 bert:512 gpt2:128
"""

# ruff: noqa: B023, E402, E501, F841  (kept as it ran for the numbers quoted in the docs)

import statistics
import sys
import time
import traceback

import torch

import semiring_backprop as sbp
from semiring_backprop.engine import forward, liveness
from semiring_backprop.engine.reverse import needed_nodes, reverse
from semiring_backprop.result import resolve_keep

torch.backends.cuda.matmul.allow_tf32 = False
import os

dev = os.environ.get("PROBE_DEVICE", "cuda")


def bert(T):
    from transformers import BertConfig, BertModel

    m = BertModel(
        BertConfig(
            hidden_size=512,
            num_hidden_layers=6,
            num_attention_heads=8,
            intermediate_size=2048,
            max_position_embeddings=1024,
        ),
        add_pooling_layer=False,
    )
    return m, (lambda o: o.last_hidden_state[0, -1, :8].sum()), 512


def gpt2(T):
    from transformers import GPT2Config, GPT2Model

    m = GPT2Model(GPT2Config(n_positions=1024))
    return m, (lambda o: o.last_hidden_state[0, -1, :8].sum()), 768


SETS = {
    "Real": [sbp.Real()],
    "MaxProduct(tensor)": [sbp.MaxProduct("tensor")],
    "MaxProduct": [sbp.MaxProduct()],
    "three": [sbp.Real(), sbp.MaxProduct(), sbp.Entropy()],
    "TopK(3)": [sbp.TopK(3)],
}


def timed(fn, reps=5):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def readouts(sr, v):
    ro = sr.finalize(v)
    if isinstance(ro, torch.Tensor):
        return [ro]
    return [getattr(ro, f) for f in ro.__dataclass_fields__]


def graphed(bp, x):
    kw = {"inputs_embeds": x}
    graph = bp.graph((), kw)
    kept = resolve_keep(graph, bp.keep)
    needed = needed_nodes(graph, graph.output_node)
    drop = liveness.unread_values(graph, needed, set(kept))
    static = x.clone()

    def step():
        with torch.no_grad():
            values, _ = forward.run_deferred(graph, (), {"inputs_embeds": static}, drop)
            return reverse(graph, values, bp.semirings, graph.output_node, kept, check=None)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    t = time.perf_counter()
    with torch.cuda.graph(g):
        store = step()
    cap = time.perf_counter() - t
    node = graph.user_inputs["inputs_embeds"]

    def run(xn):
        static.copy_(xn)
        g.replay()
        return store[node]

    return run, cap


MODELS = {}


def main():
    which = sys.argv[1:] or ["bert:20", "bert:128", "bert:512", "gpt2:20", "gpt2:128", "gpt2:512"]
    for spec in which:
        name, T = spec.split(":")
        T = int(T)
        torch.manual_seed(0)
        if name not in MODELS:
            model, out, H = {"bert": bert, "gpt2": gpt2}[name](T)
            model = model.to(dev).eval()
            MODELS[name] = (model, out, H, sbp.Backprop(model, out)._traces)
        model, out, H, traces = MODELS[name]
        x = torch.randn(1, T, H, device=dev)

        def ag():
            xx = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(out(model(inputs_embeds=xx)), xx)
            return g

        ag()
        t_ag = timed(ag)
        m_ag = peak(ag)
        print(
            f"== {name} {T} tokens: autograd {t_ag * 1e3:.2f} ms, {m_ag / 2**20:.1f} MiB",
            flush=True,
        )
        for label, srs in SETS.items():
            if label == "TopK(3)" and T > 128:
                continue
            try:
                row = []
                for keep in (None, ("inputs_embeds",)):
                    bp = sbp.Backprop(model, out, srs, keep=keep, _traces=traces)
                    t0 = time.perf_counter()
                    bp(kwargs={"inputs_embeds": x})
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    call = lambda: bp(kwargs={"inputs_embeds": x})
                    call()
                    t = timed(call)
                    m = peak(call)
                    row.append(
                        f"keep={'None' if keep is None else 'in'}: {t / t_ag:.2f}x {m / max(m_ag, 1):.2f}xmem (first {first:.1f}s)"
                    )
                res = bp(kwargs={"inputs_embeds": x})
                try:
                    run, cap = graphed(bp, x)
                    x2 = torch.randn_like(x)
                    got = run(x2)
                    want = bp(kwargs={"inputs_embeds": x2})
                    err = 0.0
                    for s, sr in enumerate(srs):
                        for a, b in zip(
                            readouts(sr, got[s]), readouts(sr, want.value("inputs_embeds", sr))
                        ):
                            if a.is_floating_point():
                                err = max(
                                    err,
                                    ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item(),
                                )
                            else:
                                err = max(err, float((a != b).float().mean().item()))
                    tg = timed(lambda: run(x))
                    mg = peak(lambda: run(x))
                    row.append(
                        f"graphed: {tg / t_ag:.2f}x {mg / max(m_ag, 1):.2f}xmem capture {cap:.1f}s relerr {err:.1e}"
                    )
                except Exception as e:
                    tb = [
                        f
                        for f in traceback.extract_tb(e.__traceback__)
                        if "semiring_backprop" in f.filename
                    ][-3:]
                    row.append(
                        f"graphed FAILED {type(e).__name__}: {str(e)[:300]!r} at {[(f.filename.split('semiring_backprop/')[-1], f.lineno, f.name) for f in tb]}"
                    )
                print(f"  {label}: " + " | ".join(row), flush=True)
            except Exception as e:
                print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
