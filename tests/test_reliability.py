"""Results are never lost or mixed: one run per output directory, whole files written
under a temporary name and renamed, a JSON-lines file whose last line lost its newline
read back as it was, unreadable saved models trained again, settings of a run that left
no results not held against a corrected rerun."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import pytest
import torch

from semiring_backprop import InputError, experiments
from semiring_backprop._files import atomic_write
from semiring_backprop.experiments import common
from semiring_backprop.runner import records


def test_a_second_run_into_a_held_directory_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "out"
    with records.lock(out):
        with pytest.raises(InputError, match=rf"in use by another run \(process {os.getpid()}\)"):
            with records.lock(out):
                pass
        # an experiment into it stops before any work
        with pytest.raises(InputError, match="in use by another run"):
            experiments.run("sva", out, quick=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    with records.lock(out):  # released: the next run holds it
        pass


def test_an_unwritable_output_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(InputError, match="cannot write into output directory"):
        with records.lock(blocker / "out"):
            pass


def test_a_last_line_without_its_newline_is_not_glued_to_the_next(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"key": 0}) + "\n" + json.dumps({"key": 1}))  # no "\n"
    rec = records.Records(path)
    assert rec.has(0) and rec.has(1)
    rec.add({"key": 2})
    again = records.Records(path)
    assert [r["key"] for r in again.rows] == [0, 1, 2]
    assert path.read_text().count("\n") == 3


def test_a_cut_off_last_line_is_dropped_and_redone(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"key": 0}) + "\n" + '{"key": 1, "val')
    rec = records.Records(path)
    assert rec.has(0) and not rec.has(1)
    assert path.read_text() == json.dumps({"key": 0}) + "\n"


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    path = records.write_json(tmp_path / "summary.json", {"a": 1})

    def half(tmp):
        tmp.write_text('{"a": ')
        raise KeyboardInterrupt  # cut off mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, half)
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left


def test_an_unreadable_saved_model_is_trained_again(tmp_path):
    fits = []

    def fit(model):
        fits.append(1)
        with torch.no_grad():
            model.weight.fill_(len(fits))
        return [{"epoch": 1}]

    model, history = common.trained(torch.nn.Linear(2, 2), tmp_path, fit)
    assert fits == [1] and history == [{"epoch": 1}]
    model, _ = common.trained(torch.nn.Linear(2, 2), tmp_path, fit)  # loaded
    assert fits == [1] and (model.weight == 1).all()
    data = (tmp_path / "model.pt").read_bytes()
    (tmp_path / "model.pt").write_bytes(data[: len(data) // 2])  # an old, cut-off save
    model, _ = common.trained(torch.nn.Linear(2, 2), tmp_path, fit)
    assert fits == [1, 1] and (model.weight == 2).all()
    (tmp_path / "history.json").write_text("[{")
    model, _ = common.trained(torch.nn.Linear(2, 2), tmp_path, fit)
    assert len(fits) == 3


@dataclass
class _Config:
    model: str = "a"
    limit: int = 1


def test_settings_of_a_run_that_left_no_results_do_not_block_a_corrected_one(tmp_path):
    records.same_settings(tmp_path, _Config(model="typo"))  # that run failed right after
    (tmp_path / "synthetic.jsonl").write_text("{}\n")  # data made from the settings
    records.same_settings(tmp_path, _Config(model="right"))  # accepted
    assert json.loads((tmp_path / "config.json").read_text())["model"] == "right"
    (tmp_path / "examples.jsonl").write_text('{"key": 0}\n')  # now there are results
    with pytest.raises(InputError, match="other settings \\(model\\)"):
        records.same_settings(tmp_path, _Config(model="other"))
    records.same_settings(tmp_path, _Config(model="right", limit=5), free=("limit",))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="config.json is not valid JSON"):
        records.same_settings(tmp_path, _Config(model="right"))


@dataclass
class _Older:
    model: str = "a"


@dataclass
class _Newer:  # a setting added since _Older's runs, default = what they computed
    model: str = "a"
    mode: tuple = ("plain",)


def test_a_setting_missing_from_an_older_run_counts_as_its_default(tmp_path):
    records.same_settings(tmp_path, _Older())
    (tmp_path / "examples.jsonl").write_text('{"key": 0}\n')
    records.same_settings(tmp_path, _Newer())  # the older run computed the default
    (tmp_path / "config.json").write_text('{"model": "a"}')
    with pytest.raises(InputError, match="other settings \\(mode\\)"):
        records.same_settings(tmp_path, _Newer(mode=("other",)))


@pytest.mark.parametrize(
    ("name", "setting", "needle"),
    [
        ("first-token-repeated", "max_epochs=0", "max_epochs=0: each value must be at least 1"),
        ("first-token-repeated", "heads=0", "heads=0: each value must be at least 1"),
        ("first-token-repeated", "explain_batch=0", "explain_batch=0"),
        ("first-token-repeated", "explain_limit=abc", "explain_limit='abc' should be int | None"),
        ("first-token-repeated", "hidden=15", "hidden=15 must be a multiple of heads=2"),
        ("first-token-repeated", "lr=0", "lr=0.0: each value must be a finite number above 0"),
        ("entropy-vs-mdl", "mdl_fractions=0.5,2", "in \\(0, 1\\]"),
        ("entropy-vs-mdl", "min_accuracy=1.5", "between 0 and 1"),
        ("sva", "limit=0", "limit=0"),
        ("sva", "batch_size=0", "batch_size=0: each value must be at least 1"),
        ("sva", "workers=-1", "workers=-1: each value must be 0 or more"),
        ("entropy-sanity", "bert_hidden=9", "bert_hidden=9 must be a multiple of bert_heads"),
    ],
)
def test_settings_are_checked_before_any_work(name, setting, needle, tmp_path, capsys,
                                              monkeypatch):  # fmt: skip
    from semiring_backprop.cli import main

    monkeypatch.setattr(common, "train", lambda *a, **k: pytest.fail("trained"))
    out = tmp_path / "out"
    assert main(["experiment", name, "--out", str(out), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert __import__("re").search(needle, err), err
    assert not out.exists()  # nothing was written


def test_every_experiments_defaults_pass_the_check():
    for name in experiments.EXPERIMENTS:
        experiments.config(name)
        experiments.config(name, quick=True)


def test_an_allocation_failure_is_a_clear_error_and_keeps_the_compiled_kernel(
    monkeypatch, torch_kernels
):
    """A pass that cannot allocate says what uses less, and the compiled kernel it ran
    out of memory in is not switched off for the rest of the process."""
    import semiring_backprop as sbp
    from semiring_backprop import kernels

    monkeypatch.setattr(kernels, "MIN_WORK", 0)
    monkeypatch.setitem(kernels._state, "compile", True)
    monkeypatch.setitem(kernels._state, "failed", set())

    def no_memory(name):
        def run(*args):
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:119] DefaultCPUAllocator: "
                "can't allocate memory: you tried to allocate 9663676416 bytes"
            )

        return run

    monkeypatch.setattr(kernels, "_compiled", no_memory)
    lin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    bp = sbp.Backprop(lin.eval(), lambda y: y[0, 1], [sbp.Real(), sbp.MaxProduct()])
    with pytest.raises(
        sbp.OutOfMemoryError, match="can't allocate memory.*keep=.*fewer semirings.*float32"
    ):
        bp((torch.randn(3, 8),))
    assert not kernels._state["failed"]  # still compiled next time


def test_a_pass_over_the_memory_budget_says_so_once(monkeypatch):
    """The budget's own refusal reaches the caller as written, not wrapped again as an
    allocation failure (which repeated "What uses less" around a cut copy of it)."""
    import semiring_backprop as sbp

    monkeypatch.setenv("SEMIRING_BACKPROP_MEMORY", "1000")
    with pytest.raises(sbp.OutOfMemoryError) as info:
        sbp.backprop(lambda x: (x @ x).tanh().sum(), (torch.randn(64, 64),),
                     semirings=[sbp.TopK(3)])  # fmt: skip
    message = str(info.value)
    assert message.startswith("the reverse pass needs at least")
    assert message.count("What uses less") == 1 and "ran out of memory" not in message
    assert "keep=(" in message  # keep= was not given: holding fewer readouts would help
    with pytest.raises(sbp.OutOfMemoryError) as info:
        sbp.backprop(lambda x: (x @ x).tanh().sum(), (torch.randn(64, 64),),
                     semirings=[sbp.TopK(3)], keep=[0])  # fmt: skip
    assert "keep=(" not in str(info.value)  # given already


def test_an_input_longer_than_learned_positions_is_refused_before_tracing():
    transformers = pytest.importorskip("transformers")
    import semiring_backprop as sbp

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16)  # fmt: skip
    bert = transformers.BertForMaskedLM(cfg).eval()
    with pytest.raises(InputError, match=r"20 positions long .* has 16 positions: shorten"):
        sbp.backprop(bert, kwargs={"input_ids": torch.randint(0, 50, (1, 20))},
                     output=lambda o: o.logits[0, 0, 1])  # fmt: skip
    # rotary positions have no table to outgrow: a longer input runs
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=8)  # fmt: skip
    llama = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (1, 12))
    res = sbp.backprop(llama, kwargs={"input_ids": ids}, output=lambda o: o.logits[0, -1, 1])
    assert res.graph is not None


@pytest.mark.parametrize(
    ("device", "needle"),
    [
        ("gpu", "'gpu' is not a device name"),
        ("cuda", "no CUDA device here"),
        ("cuda:7", "cuda:7"),
    ],  # fmt: skip
)
def test_explain_checks_the_device_before_loading(device, needle, tmp_path, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if device == "cuda:7" and torch.cuda.device_count() > 7:  # (fewer: refused by count)
        pytest.skip("this machine has a CUDA device 7")
    from semiring_backprop.cli import main

    rc = main(["explain", str(tmp_path / "no-model"), "--text", "a [MASK] b",
               "--target", "x", "--foil", "y", "--device", device])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and needle in err, err


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ([[1, 60, 3]], r"an id is outside the table .* 60 .* 50 rows \(ids 0..49\)"),
        (torch.zeros(0, 5, dtype=torch.long), r"input 'input_ids' is empty \(shape \(0, 5\)\)"),
        (torch.zeros(1, 0, dtype=torch.long), r"input 'input_ids' is empty \(shape \(1, 0\)\)"),
    ],
)
def test_ids_outside_the_vocabulary_and_empty_inputs_are_clear_errors(ids, needle):
    transformers = pytest.importorskip("transformers")
    import semiring_backprop as sbp

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32)  # fmt: skip
    bert = transformers.BertForMaskedLM(cfg).eval()
    with pytest.raises(sbp.SemiringBackpropError, match=needle):
        sbp.backprop(bert, kwargs={"input_ids": torch.as_tensor(ids)},
                     output=lambda o: o.logits.sum())  # fmt: skip


def _held_peak(fn) -> int:
    """Peak bytes held by tensors during ``fn()`` (every allocation and free, in order)."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # (some torch versions note how the profiler keeps events)
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_a_pass_that_cannot_fit_is_refused_before_it_runs(monkeypatch):
    """The estimate is a lower bound of the pass's peak (the profiler's count), and a
    budget below it refuses the pass with the estimate and what uses less."""
    import semiring_backprop as sbp
    from semiring_backprop.engine import budget

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                              torch.nn.Linear(256, 64), torch.nn.Tanh()).eval()  # fmt: skip
    x = torch.randn(32, 64)
    srs = [sbp.Real(), sbp.MaxProduct(), sbp.Entropy(), sbp.TopK(3)]
    seen = []
    real = budget.reverse_peak
    monkeypatch.setattr(budget, "reverse_peak", lambda *a: seen.append(real(*a)) or seen[-1])
    bp = sbp.Backprop(mlp, lambda y: y.sum(), srs, keep=(0,))
    bp((x,))
    estimate = seen[-1]
    assert 0 < estimate <= _held_peak(lambda: bp((x,)))
    monkeypatch.setenv("SEMIRING_BACKPROP_MEMORY", str(estimate - 1))
    with pytest.raises(sbp.OutOfMemoryError, match=r"needs at least .* GiB .* fewer semirings"):
        bp((x,))
    monkeypatch.setenv("SEMIRING_BACKPROP_MEMORY", str(estimate))
    bp((x,))


def test_sizes_past_the_recompile_limit_run_eagerly_and_keep_the_compiled_kernel(
    monkeypatch, torch_kernels
):
    """A kernel compiled for too many mixes of sizes (dims of size 1 are specialized)
    runs those sizes eagerly, the same values, and stays compiled for the sizes it was
    compiled for: not switched off for the rest of the process."""
    import semiring_backprop as sbp
    from semiring_backprop import kernels

    monkeypatch.setattr(kernels, "MIN_WORK", 0)
    monkeypatch.setitem(kernels._state, "compile", True)
    monkeypatch.setitem(kernels._state, "failed", set())
    lin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    bp = sbp.Backprop(lin.eval(), lambda y: y[0, 1], [sbp.MaxProduct()])
    x = torch.randn(3, 8)
    ref = bp((x,)).at(0, sbp.MaxProduct()).hi
    seen = []

    def limited(name):
        def run(*args):
            seen.append(name)
            raise torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

        return run

    monkeypatch.setattr(kernels, "_compiled", limited)
    got = bp((x,)).at(0, sbp.MaxProduct()).hi
    assert seen  # the compiled kernel was tried, and its sizes ran eagerly
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert not kernels._state["failed"]  # still compiled for other sizes
