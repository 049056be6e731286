"""Battery cases: what is explained, loading, the CLI's set-up and Captum (issue 29).

Checkpoints without tokenizer files; ``--score logprob`` on a one-output head; a
multi-label head; a causal LM whose tokenizer appends an end token; a ``vocab_size``
edited in ``config.json``; pickled weights; ``semirings='max'``; Captum's
``baselines=`` and ``NoiseTunnel``; a checkpoint explained twice.

Oracles: the saved model's own logits (recomputed here with transformers),
``torch.autograd``, and Captum's own ``Saliency`` under the same noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import semiring_backprop as sbp
from battery import SPECIAL, TEXT, WORDS, Cli, case, clear, close, explain_argv, graceful

SHORT = "the keys are on the table"


# -- saved checkpoints, built once ---------------------------------------------------------


def _dirs(env) -> dict:
    return env.memo("targets_dirs", lambda: _save_dirs(env.root / "targets"))


def _save_dirs(root: Path) -> dict:
    import transformers

    was = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        dirs = {}
        for name, cls, tok, cfg in [
            ("cls_notok", transformers.BertForSequenceClassification, False, {}),
            ("enc_notok", transformers.BertModel, False, {}),
            ("mlm_notok", transformers.BertForMaskedLM, False, {}),
            ("one_output", transformers.BertForSequenceClassification, True, {"num_labels": 1}),
            ("multi", transformers.BertForSequenceClassification, True,
             {"num_labels": 3, "problem_type": "multi_label_classification"}),
            ("mlm", transformers.BertForMaskedLM, True, {}),
            ("vocab_edited", transformers.BertForMaskedLM, True, {}),
        ]:  # fmt: skip
            dirs[name] = _save_bert(root / name, transformers, cls, tok, **cfg)
        c = json.loads((dirs["vocab_edited"] / "config.json").read_text())
        c["vocab_size"] = 40
        (dirs["vocab_edited"] / "config.json").write_text(json.dumps(c))
        dirs["pickled"] = _pickled(root / "pickled", dirs["mlm"])
        dirs["llama_eos"] = _llama_with_end_token(root / "llama_eos", transformers)
        return dirs
    finally:
        if was:
            transformers.utils.logging.enable_progress_bar()


def _save_bert(d: Path, transformers, cls, tokenizer=True, **config) -> Path:
    d.mkdir(parents=True)
    vocab = SPECIAL + WORDS + ["##s"]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizer(str(d / "vocab.txt"))
    if tokenizer:
        tok.save_pretrained(d)
    else:
        (d / "vocab.txt").unlink()
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, **config)  # fmt: skip
    torch.manual_seed(0)
    cls(cfg).save_pretrained(d)
    return d


class _Planted:
    """Pickled, it calls ``open(path, "w")``: the file appears only if the code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickled(d: Path, src: Path) -> Path:
    from safetensors.torch import load_file

    d.mkdir(parents=True)
    for p in src.iterdir():
        if p.suffix != ".safetensors":
            (d / p.name).write_bytes(p.read_bytes())
    weights = dict(load_file(src / "model.safetensors"))
    weights["planted"] = _Planted(d.parent / "pickled-code-ran")
    torch.save(weights, d / "pytorch_model.bin")
    return d


def _llama_with_end_token(d: Path, transformers) -> Path:
    import tokenizers
    from tokenizers.processors import TemplateProcessing

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>"] + WORDS)}
    wl = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    wl.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    wl.post_processor = TemplateProcessing(single="<s> $A </s>",
                                           special_tokens=[("<s>", 1), ("</s>", 2)])  # fmt: skip
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]",
                                               bos_token="<s>", eos_token="</s>")  # fmt: skip
    tok.save_pretrained(d)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=16,
                                   bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _logits(d, cls_name, text, **tok_kw):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = getattr(transformers, cls_name).from_pretrained(d).eval()
    enc = tok(text, return_tensors="pt", **tok_kw)
    enc.pop("token_type_ids", None)
    with torch.no_grad():
        return model(**enc).logits[0].double(), tok


# -- 1. a checkpoint directory without tokenizer files ---------------------------------


@clear("cli.targets-classification-no-tokenizer", r"no tokenizer vocabulary.*save_pretrained")
def _(env):
    """a classifier saved without its tokenizer: transformers reads every word as [UNK]"""
    d = _dirs(env)["cls_notok"]
    return Cli(["explain", str(d), "--task", "classification", "--text", SHORT])


@clear("cli.targets-similarity-no-tokenizer", r"no tokenizer vocabulary.*save_pretrained")
def _(env):
    d = _dirs(env)["enc_notok"]
    return Cli(["explain", str(d), "--task", "similarity", "--text", SHORT, "--text-pair",
                "a dog", "--pooling", "mean"])  # fmt: skip


@clear("cli.targets-run-no-tokenizer", r"no tokenizer vocabulary")
def _(env):
    """run says the same as explain"""
    d = _dirs(env)["mlm_notok"]
    data = env.tmp("targets-run-notok") / "data.jsonl"
    data.write_text(json.dumps({"text": TEXT, "target": "are", "foil": "is"}) + "\n")
    out = env.tmp("targets-run-notok") / "out"
    return Cli(["run", str(d), "--data", str(data), "--out", str(out), "--no-figures"])


@clear("targets.foreign-tokenizer-knows-no-word", r"no word of the text is in the tokenizer")
def _(env):
    """a loaded classifier with a tokenizer whose vocabulary has none of the text's words"""
    import tokenizers
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        _dirs(env)["multi"]).eval()  # fmt: skip
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "zebra": 3}
    wl = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    wl.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]",
                                               cls_token="[CLS]", sep_token="[SEP]")  # fmt: skip
    from semiring_backprop.hf.explain import explain

    return explain(model, SHORT, task="classification", tokenizer=tok)


# -- 2. the explained scalar is the one asked for --------------------------------------


@clear("cli.targets-logprob-one-output", r"head with one output.*--score logit")
def _(env):
    """--score logprob on a one-output head: log_softmax of one number is 0"""
    d = _dirs(env)["one_output"]
    return Cli(["explain", str(d), "--task", "classification", "--text", SHORT, "--score",
                "logprob"])  # fmt: skip


@clear("targets.classlabel-logprob-one-output", r"head with one output")
def _(env):
    mlp = nn.Sequential(nn.Linear(4, 1)).eval()
    return sbp.backprop(mlp, (torch.randn(1, 4),), output=sbp.ClassLabel(0, score="logprob"))


def _multi_check(foil):
    def check(ex, env):
        z, _ = _logits(_dirs(env)["multi"], "AutoModelForSequenceClassification", SHORT)
        ls = torch.nn.functional.logsigmoid(z)
        want = ls[1] - (0 if foil is None else ls[foil])
        return close(ex.score, want)

    return check


@graceful("targets.multi-label-logprob", _multi_check(None))
def _(env):
    """a multi-label head's log-probability is log-sigmoid of its logit"""
    from semiring_backprop.hf.explain import explain

    return explain(str(_dirs(env)["multi"]), SHORT, "1", task="classification",
                   score="logprob", semirings=["real"])  # fmt: skip


@graceful("targets.multi-label-logprob-margin", _multi_check(2))
def _(env):
    from semiring_backprop.hf.explain import explain

    return explain(str(_dirs(env)["multi"]), SHORT, "1", "2", task="classification",
                   score="logprob", semirings=["real"])  # fmt: skip


def _mlp3():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()


_X = torch.randn(1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _multi_grad(res, env):
    x = _X.clone().requires_grad_()
    ls = torch.nn.functional.logsigmoid(_mlp3()(x)[0])
    (want,) = torch.autograd.grad(ls[1] - ls[2], x)
    return close(res.at(0, sbp.Real()), want)


@graceful("targets.multi-label-gradient", _multi_grad)
def _(env):
    target = sbp.ClassLabel(1, foil=2, score="logprob", multi_label=True)
    return sbp.backprop(_mlp3(), (_X,), output=target, semirings=[sbp.Real()])


def _after_text(ex, env):
    d = _dirs(env)["llama_eos"]
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.tensor(
        [[1] + tok("the keys to the cabinet", add_special_tokens=False)["input_ids"]]
    )
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, -1].double().log_softmax(-1)
    if "</s>" in ex.tokens:
        return f"explained with the end token: {ex.tokens}"
    return close(
        ex.score, logp[tok.convert_tokens_to_ids("are")] - logp[tok.convert_tokens_to_ids("is")]
    )


@graceful("targets.causal-lm-end-token", _after_text)
def _(env):
    """a tokenizer that appends </s>: the next word is read after the text"""
    from semiring_backprop.hf.explain import explain

    return explain(str(_dirs(env)["llama_eos"]), "the keys to the cabinet", "are", "is",
                   semirings=["real"])  # fmt: skip


# -- 3. errors that say what to do -------------------------------------------------------


@clear("cli.targets-vocab-size-edited", r"config\.json.*vocab_size=40.*save_pretrained")
def _(env):
    return Cli(explain_argv(_dirs(env)["vocab_edited"]))


@clear("cli.targets-pickled-weights", r"pickled code.*safetensors")
def _(env):
    return Cli(explain_argv(_dirs(env)["pickled"]))


def _one_name(ex, env):
    if [s.name for s in ex.result.semirings] != ["Real"]:
        return f"computed {ex.result.semirings}"
    z, tok = _logits(_dirs(env)["mlm"], "AutoModelForMaskedLM", TEXT)
    logp = z[6].log_softmax(-1)
    return close(ex.score, logp[tok.vocab["are"]] - logp[tok.vocab["is"]])


@graceful("targets.explain-one-semiring-name", _one_name)
def _(env):
    """semirings='real' is one name, not the letters r, e, a, l"""
    from semiring_backprop.hf.explain import explain

    return explain(str(_dirs(env)["mlm"]), TEXT, "are", "is", semirings="real")


def _same_tables(pair, env):
    """``run(semirings='max')`` wrote the tables ``run(semirings=['max'])`` writes."""
    one, listed = (sbp.load_results(d)["tokens"] for d in pair)
    if not any("max" in c for c in one.columns) or any("entropy" in c for c in one.columns):
        return f"columns {list(one.columns)}"
    return True if one.equals(listed) else "the tables differ"


@graceful("targets.run-one-semiring-name", _same_tables)
def _(env):
    """semirings='max' in run is one name, not the letters m, a, x"""
    outs = []
    for name, given in (("one", "max"), ("list", ["max"])):
        out = env.tmp(f"targets-run-max-{name}") / "out"
        sbp.run(str(_dirs(env)["mlm"]), examples=[{"text": TEXT, "target": "are",
                "foil": "is"}], out=out, semirings=given, progress=False)  # fmt: skip
        outs.append(out)
    return outs


def _mlp2():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double().eval()


_XS = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))


@clear("targets.captum-baselines", r"no baselines=.*IntegratedGradients")
def _(env):
    from semiring_backprop.captum import SemiringAttribution

    return SemiringAttribution(_mlp2()).attribute(_XS, target=1, baselines=torch.zeros_like(_XS))


def _as_saliency(got, env):
    from captum.attr import NoiseTunnel, Saliency

    torch.manual_seed(5)
    want = NoiseTunnel(Saliency(_mlp2())).attribute(_XS, nt_samples=4, stdevs=0.1, target=1,
                                                     abs=False)  # fmt: skip
    return close(got, want)


@graceful("targets.captum-noise-tunnel", _as_saliency)
def _(env):
    """SmoothGrad: NoiseTunnel around SemiringAttribution(Real) is NoiseTunnel(Saliency)"""
    from captum.attr import NoiseTunnel

    from semiring_backprop.captum import SemiringAttribution

    torch.manual_seed(5)
    return NoiseTunnel(SemiringAttribution(_mlp2())).attribute(_XS, nt_samples=4, stdevs=0.1,
                                                               target=1)  # fmt: skip


# -- 4. a checkpoint explained twice ----------------------------------------------------


def _loaded_once(got, env):
    loads, first, second = got
    if loads != 1:
        return f"loaded {loads} times"
    z, tok = _logits(_dirs(env)["mlm"], "AutoModelForMaskedLM", TEXT)
    logp = z[6].log_softmax(-1)
    want = logp[tok.vocab["are"]] - logp[tok.vocab["is"]]
    ok = close(first.score, want)
    return ok if ok is not True else close(second.score, want)


@case("targets.explain-twice-loads-once", "graceful", check=_loaded_once)
def _(env):
    """the second explain(DIR) reuses the loaded model (and so its trace)"""
    from unittest import mock

    from semiring_backprop.hf import explain as mod

    mod.clear_loaded()
    real = mod.load
    with mock.patch.object(mod, "load", side_effect=real) as spy:
        first = mod.explain(str(_dirs(env)["mlm"]), TEXT, "are", "is", semirings=["real"])
        second = mod.explain(str(_dirs(env)["mlm"]), TEXT, "are", "is", semirings=["real"])
    mod.clear_loaded()
    return spy.call_count, first, second
