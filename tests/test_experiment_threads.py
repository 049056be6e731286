"""Thread counts of the library's own tiny models: the experiments' training gives the
same weights whatever the caller's count, and every entry point (experiments, demo,
quickstart) runs its passes on one thread and leaves the caller's count as it found it."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("pandas")

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop.experiments import common, entropy_mdl, entropy_sanity, sva  # noqa: E402
from semiring_backprop.experiments import first_token as ft  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_thread_setting")


# -- training gives the same weights whatever the caller's count -------------------------


FTR = dict(n=400, max_epochs=2, explain_limit=4, explain_batch=4, seeds=1)


def _first_token_weights(threads: int) -> dict:
    """The first-token-repeated model (a small data set), trained by a caller on
    ``threads`` threads as the experiment trains it."""
    config = ft.Config(n=300)
    task = _task(config.n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = common.bert_classifier(
            config.vocab_size, 2, hidden=config.hidden, heads=config.heads,
            intermediate=config.intermediate, layers=1, length=config.length, seed=config.seed,
        )  # fmt: skip
        common.train(model, task.train, task.val, epochs=2, seed=config.seed, progress=False)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    return model.state_dict()


@pytest.mark.parametrize("setting", [None, "2"])
def test_trained_weights_do_not_depend_on_threads(setting, monkeypatch):
    if setting is not None:  # the setting chooses the explanation's threads, not training's
        monkeypatch.setenv("SEMIRING_BACKPROP_THREADS", setting)
    one, two = _first_token_weights(1), _first_token_weights(2)
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_training_runs_on_one_thread_whatever_the_setting(caller_threads, monkeypatch):
    monkeypatch.setenv("SEMIRING_BACKPROP_THREADS", "2")
    seen = _spy(monkeypatch, torch.nn.functional, "cross_entropy")
    task = _task(60)
    model = common.bert_classifier(20, 2, hidden=8, heads=2, intermediate=16, layers=1,
                                   length=10)  # fmt: skip
    common.train(model, task.train, epochs=1, progress=False)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == caller_threads


def _task(n):
    from semiring_backprop.data import make_task

    return make_task("FirstTokenRepeatedOnce", n, length=10, vocab_size=20, seed=0)


# -- every entry point: one thread inside, the caller's count after ---------------------


def _spy(monkeypatch, module, name) -> list[int]:
    """Record the thread count at each call of ``module.name``."""
    seen, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


TINY_BERT = dict(bert_hidden=16, bert_layers=1, bert_heads=2, bert_intermediate=32)
MDL = entropy_mdl.Config(
    tasks=("Contains1",), seeds=(0,), sizes=(40, 6, 6), length=6, vocab_size=8, hidden=8,
    heads=2, intermediate=16, layers=1, epochs=1, mdl_epochs=1,
    mdl_fractions=(0.5, 1.0), explain_batch=2, explain_limit=2,
)  # fmt: skip


def _demo(out, monkeypatch):
    from semiring_backprop.cli import main

    tiny = ft.Config(**FTR)
    monkeypatch.setattr(ft.Config, "quick", classmethod(lambda cls: tiny))
    assert main(["demo", "--out", str(out)]) == 0


ENTRY_POINTS = {
    "demo": _demo,
    "quickstart": lambda out, mp: sbp_quickstart(),
    "entropy-vs-mdl": lambda out, mp: entropy_mdl.run(out, MDL, progress=False),
    "entropy-sanity": lambda out, mp: entropy_sanity.run(out, entropy_sanity.Config(
        lengths=(4,), per_length=1, vocab_words=20, hidden_sizes=(4,), n=60, epochs=1,
        **TINY_BERT), progress=False),
    "sva": lambda out, mp: sva.run(out, sva.Config(limit=2, synthetic=4, **TINY_BERT),
                                   progress=False),
}  # fmt: skip


def sbp_quickstart():
    from semiring_backprop.quickstart import run

    run(print_fn=lambda *a: None)


@pytest.mark.usefixtures("_offline_quiet")
@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_entry_points_use_one_thread_and_restore(name, caller_threads, tmp_path, monkeypatch):
    seen = _spy(monkeypatch, sbp.Backprop, "__call__")  # sbp.backprop calls it too
    ENTRY_POINTS[name](tmp_path, monkeypatch)
    assert seen and set(seen) == {1}, "every semiring pass on the tiny model: one thread"
    assert torch.get_num_threads() == caller_threads


def test_a_given_masked_lm_keeps_the_callers_threads(caller_threads):
    with entropy_sanity.lm_threads(sva.Config()):  # the random small BERT: one thread
        assert torch.get_num_threads() == 1
    with entropy_sanity.lm_threads(sva.Config(model="bert-base-uncased")):
        assert torch.get_num_threads() == caller_threads
    assert torch.get_num_threads() == caller_threads
