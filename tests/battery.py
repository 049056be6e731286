"""A battery of bad inputs and faults, tried the way a careful user would try them.

Each case says what it tries and what a good outcome is, and the classifier puts what
happened in one class:

- ``clear``: an error of the library's family (``SemiringBackpropError``) or, for the
  command line, exit status 2 with an ``error:`` line, whose message names what was
  wrong (the case's ``names`` pattern); no traceback.
- ``graceful``: it works, and the result agrees with an independent oracle
  (``torch.autograd``, the brute-force path enumerator in ``tests/oracles.py``, values
  the case computes itself) or the case is reported explicitly.
- ``raw``: any other exception, a traceback printed, or an error that does not say what
  was wrong.
- ``crash``: a command killed by a signal (segfault, abort, an OOM kill) or hung.
- ``silent``: a wrong result, NaN passed as a result, bad input accepted without a word,
  or data lost or duplicated.

Library calls run in this process on tiny models built once; command-line cases run
in a child process forked from a server that imported torch and transformers once
(``multiprocessing``'s forkserver), so a crash is seen as a signal and no case pays
the import again.

    python tests/battery.py            # the table of counts and every case not good
    python tests/battery.py -k cli     # only cases whose name contains "cli"
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing
import os
import re
import resource
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))  # oracles.py, when run as a script

import oracles  # noqa: E402
import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import SemiringBackpropError  # noqa: E402

CLASSES = ("clear", "graceful", "raw", "crash", "silent")
GOOD = ("clear", "graceful")
CLI_TIMEOUT = 120  # seconds; a command past it is killed and counted as a crash (hung)


@dataclass(frozen=True)
class Case:
    """One thing a careful user tries. ``run(env)`` does it (library cases return what the
    call returned; command-line cases return a :class:`Cli`). ``expect``: the good
    outcome. ``names``: a regex the error message must match (what was wrong).
    ``check(value, env)``: the oracle for a graceful outcome; True, or a string saying
    what is wrong."""

    name: str
    expect: str
    run: Callable
    names: str = ""
    check: Callable | None = None
    what: str = ""


@dataclass
class Cli:
    """A command line to run in a child process."""

    argv: list
    hold: Path | None = None  # an output directory another run holds meanwhile
    stdin: str = ""


@dataclass
class Ran:
    """What a command did: exit status (negative: killed by that signal), output."""

    code: int
    out: str
    err: str
    cpu: float = 0.0  # seconds the child spent on a CPU


@dataclass
class Outcome:
    kind: str
    detail: str


CASES: list[Case] = []


def case(name, expect, names="", check=None, what=""):
    """Decorator: the function is the case's ``run``."""

    def add(fn):
        CASES.append(Case(name, expect, fn, names, check, what or (fn.__doc__ or "").strip()))
        return fn

    return add


def clear(name, names, what=""):
    return case(name, "clear", names=names, what=what)


def graceful(name, check, what=""):
    return case(name, "graceful", check=check, what=what)


# =====================================================================================
# Shared tiny models and files (built once per battery run)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)
        self.norm = nn.LayerNorm(3)

    def forward(self, x):
        return self.fc2(self.act(self.norm(self.fc1(x))))


class Chain(nn.Module):
    """``depth`` 1x1 linear layers with weight ``scale``: one path, product scale**depth."""

    def __init__(self, depth=20, scale=1e3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(depth))
        for layer in self.layers:
            nn.init.constant_(layer.weight, scale)
        self.eval()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Env:
    """Models, inputs and files the cases share; built lazily, once."""

    def __init__(self, root: Path):
        self.root = root
        self._memo: dict = {}
        self.started: dict = {}  # case name -> Future of a command line run early
        self.cpu = 0.0  # CPU seconds of the command-line children

    def memo(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def tmp(self, name: str) -> Path:
        d = self.root / "cases" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def net(self) -> Net:
        """A fresh seeded Net (cases that change it get their own)."""
        torch.manual_seed(0)
        return Net().eval()

    @property
    def x(self):
        return self.memo("x", lambda: torch.randn(1, 4, generator=torch.Generator().manual_seed(1)))

    def net_result(self):
        """One pass over Net with Real, MaxProduct, TopK(3)."""
        return self.memo(
            "net_result",
            lambda: sbp.backprop(
                self.net(),
                (self.x,),
                output=lambda y: y[0, 1],
                semirings=[sbp.Real(), sbp.MaxProduct(), sbp.TopK(3)],
            ),
        )

    def bert(self):
        return self.memo("bert", _tiny_bert)

    def bert_result(self):
        def make():
            ids = torch.tensor([[2, 5, 6, 7, 4, 3]])
            return sbp.backprop(
                self.bert(),
                kwargs={"input_ids": ids},
                output=lambda o: o.last_hidden_state[0, 4].sum(),
                semirings=[sbp.Real(), sbp.MaxProduct(), sbp.Entropy()],
            )

        return self.memo("bert_result", make)

    def model_dirs(self) -> dict:
        return self.memo("dirs", lambda: _model_dirs(self.root / "models"))


def _tiny_bert():
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=20,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=12,
    )
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


WORDS = "the keys to cabinet is are on table a dog cat".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXT = "the keys to the cabinet [MASK] on the table"


def _model_dirs(root: Path) -> dict:
    """Saved tiny models, whole and broken in the ways users break them."""
    import transformers

    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        return _save_model_dirs(root, transformers)
    finally:
        if was_enabled:
            transformers.utils.logging.enable_progress_bar()


def _save_model_dirs(root: Path, transformers) -> dict:
    dirs = {}

    def bert(name, cls=transformers.BertForMaskedLM, vocab=SPECIAL + WORDS + ["##s"]):
        d = root / name
        d.mkdir(parents=True)
        (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
        transformers.BertTokenizer(str(d / "vocab.txt")).save_pretrained(d)
        cfg = transformers.BertConfig(
            vocab_size=len(vocab),
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
        )
        torch.manual_seed(0)
        cls(cfg).save_pretrained(d)
        dirs[name] = d
        return d

    bert("bert")
    bert("classifier", transformers.BertForSequenceClassification)
    nomask = bert("nomask", vocab=["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + WORDS)
    cfg = json.loads((nomask / "tokenizer_config.json").read_text())
    cfg.pop("mask_token", None)
    for entry in cfg.get("added_tokens_decoder", {}).values():
        if entry.get("content") == "[MASK]":
            entry["content"] = "[PAD]"
    (nomask / "tokenizer_config.json").write_text(json.dumps(cfg))
    stm = nomask / "special_tokens_map.json"
    if stm.exists():
        m = json.loads(stm.read_text())
        m.pop("mask_token", None)
        stm.write_text(json.dumps(m))

    def variant(name, keep=lambda p: True, edit=None):
        d = root / name
        d.mkdir(parents=True)
        for p in dirs["bert"].iterdir():
            if keep(p):
                (d / p.name).write_bytes(p.read_bytes())
        if edit:
            edit(d)
        dirs[name] = d

    variant("config_only", keep=lambda p: p.name == "config.json")
    variant("no_weights", keep=lambda p: not p.name.endswith((".safetensors", ".bin")))
    variant("no_tokenizer", keep=lambda p: p.name in ("config.json", "model.safetensors"))
    variant("empty", keep=lambda p: False)

    def corrupt_config(d):
        (d / "config.json").write_text('{"model_type": "bert", "hidden_size": ')

    variant("corrupt_config", edit=corrupt_config)

    def truncate_weights(d):
        w = d / "model.safetensors"
        w.write_bytes(w.read_bytes()[:200])

    variant("cut_weights", edit=truncate_weights)

    def garbage_weights(d):
        (d / "model.safetensors").write_bytes(b"\x00\xff" * 500)

    variant("garbage_weights", edit=garbage_weights)

    def unknown_type(d):
        c = json.loads((d / "config.json").read_text())
        c["model_type"] = "no-such-architecture"
        (d / "config.json").write_text(json.dumps(c))

    variant("unknown_type", edit=unknown_type)

    def remote_code(d):
        c = json.loads((d / "config.json").read_text())
        c["auto_map"] = {
            "AutoModelForMaskedLM": "modeling_custom.CustomModel",
            "AutoConfig": "configuration_custom.CustomConfig",
        }
        c["model_type"] = "custom-remote"
        (d / "config.json").write_text(json.dumps(c))
        (d / "modeling_custom.py").write_text("raise SystemExit('remote code ran')\n")
        (d / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")

    variant("remote_code", edit=remote_code)

    def word_level_tokenizer(d):
        """A fast word-level tokenizer over the same ids, without a mask token."""
        import tokenizers
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import Whitespace

        for p in d.iterdir():
            if "token" in p.name or p.name == "vocab.txt":
                p.unlink()
        vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + ["##s"]) if w != "[MASK]"}
        tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = Whitespace()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
        fast.save_pretrained(d)

    variant("fast_nomask", edit=word_level_tokenizer)

    def config_is_list(d):
        (d / "config.json").write_text("[1, 2, 3]")

    variant("config_list", edit=config_is_list)
    return dirs


def _cli_score(env, text=TEXT, target="are", foil="is", dtype=torch.float32) -> float:
    """log p(target) - log p(foil) at [MASK], from the saved model's own logits."""
    import transformers

    d = env.model_dirs()["bert"]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForMaskedLM.from_pretrained(d, dtype=dtype).eval()
    enc = tok(text, return_tensors="pt")
    pos = int((enc["input_ids"][0] == tok.mask_token_id).nonzero()[0])
    with torch.no_grad():
        enc.pop("token_type_ids", None)
        logp = model(**enc).logits[0, pos].log_softmax(-1)
    return float(logp[tok.convert_tokens_to_ids(target)] - logp[tok.convert_tokens_to_ids(foil)])


# =====================================================================================
# Oracles


def close(a, b, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != expected {tuple(b.shape)}"
    if not torch.isfinite(a).all():
        return f"non-finite values: {a}"
    if not torch.allclose(a, b, rtol=tol, atol=tol):
        return f"{a.flatten()[:6].tolist()} != expected {b.flatten()[:6].tolist()}"
    return True


def autograd(model, args, output, kwargs=None, at=0):
    """The gradient of ``output(model(*args))`` with respect to ``args[at]``."""
    args = [a.detach().clone().requires_grad_(i == at) for i, a in enumerate(args)]
    y = output(model(*args, **(kwargs or {})))
    (g,) = torch.autograd.grad(y, args[at])
    return g


def real_matches(model, args, output, at=0, tol=1e-5):
    """Check: the result's Real value at args[at] is torch.autograd's gradient."""
    return lambda res, env: close(res.at(at, sbp.Real()), autograd(model, args, output, at=at), tol)


def max_matches_oracle(res, env, at=0):
    """MaxProduct hi and lo at input ``at`` against brute-force path enumeration."""
    want = oracles.build(res).readouts(res.node(at))
    got = res.at(at, sbp.MaxProduct())
    ok = close(got.hi, torch.from_numpy(want["hi"]), 1e-5)
    return ok if ok is not True else close(got.lo, torch.from_numpy(want["lo"]), 1e-5)


# =====================================================================================
# backprop / Backprop: outputs, semirings, inputs


def out01(y):
    return y[0, 1]


def _bp(env, output=out01, semirings=None, args=None, model=None, **kw):
    semirings = [sbp.Real()] if semirings is None else semirings
    model = env.net() if model is None else model
    return sbp.backprop(
        model, (env.x,) if args is None else args, output=output, semirings=semirings, **kw
    )


@clear("api.output-vector", r"shape \(1, 2\).*scalar")
def _(env):
    """output returns the whole logit vector"""
    return _bp(env, output=lambda y: y)


@clear("api.output-row", r"shape \(2,\).*per_example")
def _(env):
    return _bp(env, output=lambda y: y[0])


@clear("api.output-none-vector", r"shape \(1, 2\)")
def _(env):
    """no output function and a model whose output is not a scalar"""
    return _bp(env, output=None)


@graceful("api.output-none-scalar", lambda r, env: close(r.at(0, sbp.Real()), 2 * env.x))
def _(env):
    return sbp.backprop(lambda x: (x * x).sum(), (env.x,))


@clear("api.output-tuple", r"returned 2 tensors")
def _(env):
    return _bp(env, output=lambda y: (y[0, 0], y[0, 1]))


@clear("api.output-int", r"int64.*must be float")
def _(env):
    return _bp(env, output=lambda y: y.argmax())


@clear("api.output-python-float", r"(item|float|tensor|scalar|data-dependent)")
def _(env):
    """output calls .item(): a Python number, not a tensor of the graph"""
    return _bp(env, output=lambda y: y[0, 1].item())


@clear("api.output-string", r"(must return a tensor|str)")
def _(env):
    return _bp(env, output=lambda y: "logit")


@clear("api.output-index-out-of-range", r"(index 5|out of (range|bounds)|size 2)")
def _(env):
    return _bp(env, output=lambda y: y[0, 5])


@clear(
    "api.output-indexes-a-tensor-by-name",
    r"IndexError: too many indices.*output\(model\(\.\.\.\)\) fails.*check the output function",
)
def _(env):
    """output reads a field (``y["logits"]``) of a model that returns a plain tensor"""
    return _bp(env, output=lambda y: y["logits"][0, 1])


@clear("api.output-constant", r"(depend|no input|not on any path|constant)")
def _(env):
    """the output does not depend on the input at all"""
    return _bp(env, output=lambda y: torch.ones(()))


@graceful("api.output-times-zero", lambda r, env: close(r.at(0, sbp.Real()), torch.zeros(1, 4)))
def _(env):
    """output depends on the input with weight 0: the gradient is exactly 0"""
    return _bp(env, output=lambda y: y[0, 1] * 0.0)


@graceful(
    "api.output-negative-index",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), lambda y: y[0, -1])),
)
def _(env):
    return _bp(env, output=lambda y: y[0, -1])


@graceful(
    "api.output-sum-of-batch",
    lambda r, env: close(
        r.at(0, sbp.Real()), autograd(env.net(), (env.x.repeat(3, 1),), lambda y: y.sum())
    ),
)
def _(env):
    return _bp(env, output=lambda y: y.sum(), args=(env.x.repeat(3, 1),))


@graceful(
    "api.per-example",
    lambda r, env: close(
        r.at(0, sbp.Real()), autograd(env.net(), (env.x.repeat(3, 1),), lambda y: y[:, 1].sum())
    ),
)
def _(env):
    """per-example outputs of a batch (examples do not interact)"""
    return _bp(env, output=lambda y: y[:, 1], args=(env.x.repeat(3, 1),), per_example=True)


@clear("api.per-example-2d", r"shape \(3, 2\)")
def _(env):
    return _bp(env, output=lambda y: y, args=(env.x.repeat(3, 1),), per_example=True)


@clear("api.semirings-empty", r"semirings must be a non-empty list")
def _(env):
    return _bp(env, semirings=[])


@clear("api.semirings-class", r"semirings must be a non-empty list of Semiring instances")
def _(env):
    """the class instead of an instance"""
    return _bp(env, semirings=[sbp.Real])


@clear("api.semirings-string", r"semirings must be a non-empty list of Semiring instances")
def _(env):
    return _bp(env, semirings=["real"])


@clear("api.semirings-bare", r"semirings must be a (non-empty )?list")
def _(env):
    """one semiring, not in a list"""
    return _bp(env, semirings=sbp.Real())


@clear("api.semirings-none", r"semirings must be a (non-empty )?list")
def _(env):
    return sbp.backprop(env.net(), (env.x,), output=out01, semirings=None)


@clear("api.semirings-duplicate", r"duplicates")
def _(env):
    return _bp(env, semirings=[sbp.Real(), sbp.Real()])


@clear("api.topk-zero", r"k.*(at least 1|positive|>= ?1)")
def _(env):
    return _bp(env, semirings=[sbp.TopK(0)])


@clear("api.topk-negative", r"k.*(at least 1|positive|>= ?1)")
def _(env):
    return _bp(env, semirings=[sbp.TopK(-2)])


@clear("api.topk-float", r"k.*(integer|int)")
def _(env):
    return _bp(env, semirings=[sbp.TopK(2.5)])


@clear("api.maxproduct-granularity", r"granularity.*(neuron|tensor)")
def _(env):
    return _bp(env, semirings=[sbp.MaxProduct("bogus")])


@clear("api.model-string", r"(callable|model)")
def _(env):
    return sbp.backprop("bert-base-uncased", (env.x,), output=out01)


@clear("api.model-none", r"(callable|model)")
def _(env):
    return sbp.backprop(None, (env.x,), output=out01)


@graceful(
    "api.plain-function",
    lambda r, env: close(
        r.at(0, sbp.Real()), autograd(lambda x: (torch.sin(x) * x**3).sum(), (env.x,), lambda y: y)
    ),
)
def _(env):
    return sbp.backprop(lambda x: (torch.sin(x) * x**3).sum(), (env.x,))


@graceful(
    "api.args-bare-tensor",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), out01)),
)
def _(env):
    """args given as a bare tensor, not a tuple"""
    return sbp.backprop(env.net(), env.x, output=out01)


@graceful(
    "api.args-list", lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), out01))
)
def _(env):
    return sbp.backprop(env.net(), [env.x], output=out01)


@clear("api.args-numpy", r"(numpy|ndarray|tensor)")
def _(env):
    return _bp(env, args=(env.x.numpy(),))


@clear("api.args-list-of-floats", r"(list|tensor)")
def _(env):
    return _bp(env, args=([0.1, 0.2, 0.3, 0.4],))


@clear("api.args-missing", r"missing 1 required positional argument.*fails without tracing too")
def _(env):
    return _bp(env, args=())


@clear("api.args-extra", r"(argument|positional)")
def _(env):
    return _bp(env, args=(env.x, env.x))


@clear("api.kwargs-unknown", r"(bogus|keyword)")
def _(env):
    return sbp.backprop(env.net(), (env.x,), {"bogus": 1}, output=out01)


@clear("api.input-int", r"(Long|int64|dtype)")
def _(env):
    return _bp(env, args=(torch.ones(1, 4, dtype=torch.long),))


@clear("api.input-float64-model-float32", r"(Double|float64|dtype)")
def _(env):
    return _bp(env, args=(env.x.double(),))


@clear("api.input-float16-model-float32", r"(Half|float16|dtype)")
def _(env):
    return _bp(env, args=(env.x.half(),))


@clear("api.input-wrong-width", r"(1x5|shape|size|5)")
def _(env):
    return _bp(env, args=(torch.randn(1, 5),))


@graceful(
    "api.input-unbatched",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x[0],), lambda y: y[1])),
)
def _(env):
    """one example without its batch dimension (Linear and LayerNorm take it)"""
    return _bp(env, args=(env.x[0],), output=lambda y: y[1])


@clear("api.input-transposed", r"(1x4 and 4x3|4x1|reduction dim|shape)")
def _(env):
    """the input transposed (4, 1) where (1, 4) is expected"""
    return _bp(env, args=(env.x.t(),), output=lambda y: y[0, 0])


@clear("api.input-meta", r"(meta|device)")
def _(env):
    return _bp(env, args=(torch.randn(1, 4, device="meta"),))


@clear("api.input-complex", r"(complex)")
def _(env):
    return sbp.backprop(lambda x: (x * x).abs().sum(), (torch.randn(3, dtype=torch.cfloat),))


@clear("api.input-nan", r"NaN.*(input|args\[0\])")
def _(env):
    return _bp(env, args=(torch.tensor([[0.1, float("nan"), 0.3, 0.4]]),))


@clear("api.input-inf", r"(inf|NaN)")
def _(env):
    return _bp(env, args=(torch.tensor([[0.1, float("inf"), 0.3, 0.4]]),))


@clear("api.input-nan-maxabs", r"NaN")
def _(env):
    return _bp(env, args=(torch.tensor([[0.1, float("nan"), 0.3, 0.4]]),), semirings=[sbp.MaxAbs()])


@clear("api.weight-nan", r"NaN")
def _(env):
    net = env.net()
    with torch.no_grad():
        net.fc1.weight[0, 0] = float("nan")
    return _bp(env, model=net)


@clear("api.weight-inf", r"(inf|NaN)")
def _(env):
    net = env.net()
    with torch.no_grad():
        net.fc2.weight[1, 0] = float("inf")
    return _bp(env, model=net)


@graceful(
    "api.input-requires-grad",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), out01)),
)
def _(env):
    return _bp(env, args=(env.x.clone().requires_grad_(),))


@graceful(
    "api.input-noncontiguous",
    lambda r, env: close(
        r.at(0, sbp.Real()), autograd(env.net(), (env.x.repeat(2, 1).t().contiguous().t(),), out01)
    ),
)
def _(env):
    return _bp(env, args=(env.x.repeat(2, 1).t().contiguous().t(),))


@graceful(
    "api.float64",
    lambda r, env: close(
        r.at(0, sbp.Real()), autograd(env.net().double(), (env.x.double(),), out01), 1e-10
    ),
)
def _(env):
    return _bp(env, model=env.net().double(), args=(env.x.double(),))


@graceful(
    "api.bfloat16",
    lambda r, env: close(
        r.at(0, sbp.Real()), autograd(env.net().bfloat16(), (env.x.bfloat16(),), out01), 2e-2
    ),
)
def _(env):
    return _bp(env, model=env.net().bfloat16(), args=(env.x.bfloat16(),))


@graceful("api.empty-batch", lambda r, env: close(r.at(0, sbp.Real()), torch.zeros(0, 4)))
def _(env):
    return _bp(env, args=(torch.zeros(0, 4),), output=lambda y: y.sum())


@clear("api.training-dropout", r"training mode")
def _(env):
    model = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5), nn.Linear(3, 2)).train()
    return _bp(env, model=model)


@graceful(
    "api.training-allowed",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net().train(), (env.x,), out01)),
)
def _(env):
    """training mode explicitly allowed, on a model without randomness"""
    return _bp(env, model=env.net().train(), allow_training=True)


@clear("api.whole-unknown", r"(bogus|whole)")
def _(env):
    return _bp(env, whole=("bogus",))


@clear("api.whole-string", r"(whole|softmax)")
def _(env):
    """whole="softmax" (a string where a tuple is asked for)"""
    return _bp(env, whole="softmax")


@graceful(
    "api.whole-layer-norm",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), out01)),
)
def _(env):
    return _bp(env, whole=("layer_norm",))


@clear("api.keep-unknown", r"(fc9|no input, module)")
def _(env):
    return sbp.Backprop(env.net(), out01, keep=("fc9",))(env.x)


@clear("api.keep-pattern-matches-nothing", r"matches no module")
def _(env):
    return sbp.Backprop(env.net(), out01, keep=("*zzz*",))(env.x)


@graceful(
    "api.keep-input",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), out01)),
)
def _(env):
    return sbp.Backprop(env.net(), out01, keep=(0,))(env.x)


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


@clear("api.custom-function-reversal", r"_Reverse")
def _(env):
    """a gradient-reversal layer (custom autograd.Function)"""
    return sbp.backprop(lambda x: _Reverse.apply(x).sum() * 2, (env.x,))


@clear("api.custom-function-reversal-maxproduct", r"_Reverse")
def _(env):
    return sbp.backprop(
        lambda x: _Reverse.apply(x * x).sum(), (env.x,), semirings=[sbp.MaxProduct()]
    )


@graceful("api.custom-function-exact", lambda r, env: close(r.at(0, sbp.Real()), 3 * env.x**2))
def _(env):
    return sbp.backprop(lambda x: _Cube.apply(x).sum(), (env.x,))


TINY = 1e-25  # the forward stays finite (1e-25 x 1e60 = 1e35); the path product, 1e60, does not


@clear("api.overflow-forward", r"forward pass produced inf at node")
def _(env):
    """float32, 20 layers of weight 1e3 on an input of 1: the forward itself overflows"""
    return sbp.backprop(Chain(), (torch.ones(1, 1),), output=lambda y: y[0, 0])


@clear("api.overflow-real", r"overflowed under Real.*float64.*log-space")
def _(env):
    """float32, 20 layers of weight 1e3: a finite forward, a gradient of 1e60"""
    return sbp.backprop(Chain(), (torch.full((1, 1), TINY),), output=lambda y: y[0, 0])


@clear("api.overflow-maxproduct", r"overflowed under MaxProduct.*float64.*log-space")
def _(env):
    return sbp.backprop(
        Chain(),
        (torch.full((1, 1), TINY),),
        output=lambda y: y[0, 0],
        semirings=[sbp.MaxProduct()],
    )


@graceful(
    "api.overflow-maxabs-logspace",
    lambda r, env: close(r.at(0, sbp.MaxAbs()).log, torch.full((1, 1), 20 * math.log(1e3))),
)
def _(env):
    """the same chain in a log-space semiring: log |product| = 20 log 1e3, finite"""
    return sbp.backprop(
        Chain(), (torch.full((1, 1), TINY),), output=lambda y: y[0, 0], semirings=[sbp.MaxAbs()]
    )


@graceful(
    "api.overflow-float64",
    lambda r, env: close(r.at(0, sbp.Real()), torch.full((1, 1), 1e60, dtype=torch.float64), 1e-9),
)
def _(env):
    return sbp.backprop(
        Chain().double(), (torch.ones(1, 1, dtype=torch.float64),), output=lambda y: y[0, 0]
    )


@clear("api.memory-limit", r"(memory|MiB|GiB|bytes).*(keep=|semiring)")
def _(env):
    """a pass that cannot fit the memory the system gives (SEMIRING_BACKPROP_MEMORY)"""
    with _env_var("SEMIRING_BACKPROP_MEMORY", "1000"):
        return sbp.backprop(
            lambda x: (x @ x).tanh().sum(),
            (torch.randn(64, 64),),
            semirings=[sbp.Real(), sbp.MaxProduct(), sbp.Entropy()],
        )


@contextlib.contextmanager
def _env_var(name, value):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _item_model(x):
    return x * x.sum().item()  # a Python number read from the input


@graceful(
    "api.item-in-forward-reused",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(_item_model, (2 * env.x,), torch.sum)),
)
def _(env):
    """a forward that reads .item(), reused on another input: the number follows it"""
    bp = sbp.Backprop(_item_model, torch.sum)
    bp(env.x)
    return bp(2 * env.x)


@clear("api.python-branch-on-values", r"data-dependent")
def _(env):
    """Python control flow on a tensor's value"""
    return sbp.backprop(lambda x: x.sum() if x.sum() > 0 else -x.sum(), (env.x,))


@clear("api.output-raises", r"ZeroDivisionError.*output\(model\(\.\.\.\)\) fails")
def _(env):
    return _bp(env, output=lambda y: 1 / 0)


@clear("api.model-returns-none", r"NoneType")
def _(env):
    return sbp.backprop(lambda x: None, (env.x,), output=lambda y: y)


@graceful("api.zero-dim-input", lambda r, env: close(r.at(0, sbp.Real()), torch.tensor(6.0)))
def _(env):
    return sbp.backprop(lambda x: x * x, (torch.tensor(3.0),))


@graceful(
    "api.frozen-parameters",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), out01)),
)
def _(env):
    """parameters with requires_grad=False (a frozen model)"""
    return _bp(env, model=env.net().requires_grad_(False))


@graceful(
    "api.under-no-grad",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), out01)),
)
def _(env):
    """called inside torch.no_grad()"""
    with torch.no_grad():
        return _bp(env)


@graceful(
    "api.under-inference-mode",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), out01)),
)
def _(env):
    """called inside torch.inference_mode()"""
    net = env.net()
    with torch.inference_mode():
        return _bp(env, model=net)


@clear("api.model-made-under-inference-mode", r"Inference tensors")
def _(env):
    """a model built (or loaded) under torch.inference_mode(): its weights are inference
    tensors, which autograd's tracing cannot use"""
    with torch.inference_mode():
        net = env.net()
    return _bp(env, model=net)


@graceful("api.default-dtype-float64", lambda r, env: close(r.at(0, sbp.Real()), 2 * torch.ones(3)))
def _(env):
    """torch's default dtype set to float64 by the caller"""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return sbp.backprop(lambda x: (x * x).sum(), (torch.ones(3),))
    finally:
        torch.set_default_dtype(before)


@graceful(
    "api.keep-a-bare-int",
    lambda r, env: close(r.at(0, sbp.Real()), autograd(env.net(), (env.x,), out01)),
)
def _(env):
    """keep=0 (one place, not in a tuple)"""
    return sbp.Backprop(env.net(), out01, keep=0)(env.x)


@clear(
    "api.memory-setting-a-word", r"^(?!the pass ran out of memory).*SEMIRING_BACKPROP_MEMORY='abc'"
)
def _(env):
    """SEMIRING_BACKPROP_MEMORY=abc: a bad setting, not a lack of memory"""
    with _env_var("SEMIRING_BACKPROP_MEMORY", "abc"):
        return _bp(env)


@clear("api.memory-setting-negative", r"SEMIRING_BACKPROP_MEMORY='-5'")
def _(env):
    with _env_var("SEMIRING_BACKPROP_MEMORY", "-5"):
        return _bp(env)


@clear("api.threads-setting-a-word", r"SEMIRING_BACKPROP_THREADS='abc'")
def _(env):
    with _env_var("SEMIRING_BACKPROP_THREADS", "abc"):
        return sbp.threads()(lambda: None)()


@clear("api.threads-negative", r"threads\(n\)=-1")
def _(env):
    return sbp.threads(-1)(lambda: None)()


# -- a reused Backprop after the model changed -------------------------------------------


def _reused(env, change):
    """A Backprop called once, the model changed by ``change(net)``, called again."""
    net = env.net()
    bp = sbp.Backprop(net, out01, semirings=[sbp.Real(), sbp.MaxProduct(), sbp.Entropy()])
    bp(env.x)
    change(net)
    return bp(env.x), net


def _fresh_agrees(pair, env):
    """The second call agrees with autograd (Real) and with path enumeration (MaxProduct)
    on the changed model."""
    res, net = pair
    ok = close(res.at(0, sbp.Real()), autograd(net, (env.x,), out01))
    return ok if ok is not True else max_matches_oracle(res, env)


def _mul_data(net):
    net.fc1.weight.data.mul_(2)


def _numpy_write(net):
    net.fc2.weight.detach().numpy()[:] *= -3


def _load_state(net):
    torch.manual_seed(7)
    net.load_state_dict(Net().state_dict())


def _swap_activation(net):
    net.act = nn.ReLU().eval()


def _norm_eps(net):
    net.norm.eps = 10.0


def _inplace_no_grad(net):
    with torch.no_grad():
        net.fc2.bias.add_(5)


def _replace_parameter(net):
    net.fc1.weight = nn.Parameter(net.fc1.weight.detach() * -1)


def _hook(net):
    net.fc1.register_forward_hook(lambda m, i, o: o * 2)


for _name, _change in [
    ("p.data.mul_", _mul_data),
    ("numpy-view-write", _numpy_write),
    ("load_state_dict", _load_state),
    ("swap-activation", _swap_activation),
    ("norm-eps", _norm_eps),
    ("no_grad-add_", _inplace_no_grad),
    ("replace-parameter", _replace_parameter),
    ("forward-hook", _hook),
]:
    case(
        f"api.reuse-after-{_name}",
        "graceful",
        check=_fresh_agrees,
        what=f"a reused Backprop after {_name} changed the model",
    )(lambda env, change=_change: _reused(env, change))


# The Net (Linear, LayerNorm, Tanh) has no op that depends on the mode: a module left in
# training mode is explained as it is (a dropout or batch statistics would be refused)
@graceful("api.reuse-after-swap-to-a-training-module", _fresh_agrees)
def _(env):
    """a module swapped in without .eval(): the model is partly in training mode"""
    return _reused(env, lambda net: setattr(net, "act", nn.ReLU()))


@graceful("api.reuse-after-train", _fresh_agrees)
def _(env):
    return _reused(env, lambda net: net.fc1.train())


class Tokens(nn.Module):
    """A per-token layer and a mix over the sequence: any sequence length."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x).tanh()
        return h + h.mean(1, keepdim=True)


def _last_token(y):
    return y[0, -1].sum()


@graceful(
    "api.reuse-longer-sequence",
    lambda r, env: close(
        r.at(0, sbp.Real()), autograd(env.memo("tokens", Tokens).eval(), (_seq(7),), _last_token)
    ),
)
def _(env):
    """a reused Backprop (symbolic sequence length) called on a longer input"""
    bp = sbp.Backprop(env.memo("tokens", Tokens).eval(), _last_token)
    bp(_seq(3))
    return bp(_seq(7))


def _seq(n):
    return torch.randn(1, n, 4, generator=torch.Generator().manual_seed(n))


# -- models with token ids ----------------------------------------------------------------


def _bert_bp(env, ids, **kw):
    return sbp.backprop(
        env.bert(),
        kwargs={"input_ids": ids, **kw},
        output=lambda o: o.last_hidden_state[0, 0].sum(),
    )


@clear("api.ids-out-of-vocabulary", r"(id 25|25).*(20)")
def _(env):
    return _bert_bp(env, torch.tensor([[2, 25, 3]]))


@clear("api.ids-negative", r"(-1|negative)")
def _(env):
    return _bert_bp(env, torch.tensor([[2, -1, 3]]))


@clear("api.ids-float", r"(Float|float|dtype|Long|int)")
def _(env):
    return _bert_bp(env, torch.tensor([[2.0, 5.0, 3.0]]))


@clear("api.ids-length-zero", r"(empty|size 0|length 0|0 tokens)")
def _(env):
    return _bert_bp(env, torch.zeros(1, 0, dtype=torch.long))


@clear("api.ids-too-long", r"(12).*(position|longer|at most)")
def _(env):
    return _bert_bp(env, torch.full((1, 30), 5))


@clear("api.attention-mask-wrong-length", r"(attention_mask|size|shape)")
def _(env):
    return _bert_bp(env, torch.tensor([[2, 5, 3]]), attention_mask=torch.ones(1, 5))


@graceful(
    "api.attention-mask-zeros",
    lambda r, env: close(
        r.at("embeddings", sbp.Real()),
        _bert_embedding_grad(env, torch.tensor([[2, 5, 6, 3]]), torch.tensor([[1, 1, 0, 1]])),
        1e-4,
    ),
)
def _(env):
    return _bert_bp(env, torch.tensor([[2, 5, 6, 3]]), attention_mask=torch.tensor([[1, 1, 0, 1]]))


def _bert_embedding_grad(env, ids, mask):
    """autograd: d output / d (embeddings module output), by a hook."""
    bert, held = env.bert(), {}

    def hook(m, i, o):
        o.retain_grad()
        held["o"] = o

    h = bert.embeddings.register_forward_hook(hook)
    try:
        bert(input_ids=ids, attention_mask=mask).last_hidden_state[0, 0].sum().backward()
    finally:
        h.remove()
        bert.zero_grad(set_to_none=True)
    return held["o"].grad


# =====================================================================================
# Result methods


def _net(env):
    return env.net_result()


@clear("result.at-input-position", r"args\[5\].*tensor inputs")
def _(env):
    return _net(env).at(5, sbp.Real())


@clear("result.at-unknown-module", r"no input, module or node named 'fc9'.*fc1")
def _(env):
    return _net(env).at("fc9", sbp.Real())


@clear("result.at-float", r"at\(\) takes an int")
def _(env):
    return _net(env).at(0.5, sbp.Real())


@clear("result.at-none", r"(None|takes an int)")
def _(env):
    return _net(env).at(None, sbp.Real())


@clear("result.at-list", r"(takes an int|\[0\])")
def _(env):
    return _net(env).at([0], sbp.Real())


@clear("result.at-not-computed", r"Entropy.*not computed")
def _(env):
    return _net(env).at(0, sbp.Entropy())


@clear("result.at-semiring-class", r"(Real|not computed|Semiring)")
def _(env):
    return _net(env).at(0, sbp.Real)


@clear("result.at-semiring-string", r"('real'|not computed|Semiring)")
def _(env):
    return _net(env).at(0, "real")


@clear("result.at-topk-other-k", r"TopK.*not computed")
def _(env):
    return _net(env).at(0, sbp.TopK(5))


@clear("result.at-maxproduct-tensor-granularity", r"MaxProduct.*not computed")
def _(env):
    return _net(env).at(0, sbp.MaxProduct("tensor"))


@graceful("result.at-module-output", lambda v, env: close(v, _hooked_grad(env, "fc1")))
def _(env):
    return _net(env).at("fc1", sbp.Real())


@graceful("result.at-module-input", lambda v, env: close(v, _hooked_grad(env, "fc2", inputs=True)))
def _(env):
    return _net(env).at("fc2:input", sbp.Real())


def _hooked_grad(env, name, inputs=False):
    net, held = env.net(), {}
    module = dict(net.named_modules())[name]

    def hook(m, i, o):
        t = i[0] if inputs else o
        t.retain_grad()
        held["t"] = t

    module.register_forward_hook(hook)
    out01(net(env.x)).backward()
    return held["t"].grad


@clear("result.at-ambiguous-suffix", r"(several|ambiguous)")
def _(env):
    return env.bert_result().at("dense", sbp.Real())


@clear("result.at-integer-ids", r"int64.*no edges")
def _(env):
    return env.bert_result().at("input_ids", sbp.Real())


@clear("result.at-not-kept", r"not kept")
def _(env):
    res = sbp.Backprop(env.net(), out01, keep=(0,))(env.x)
    return res.at("fc1", sbp.Real())


@clear("result.aggregate-dim-out-of-range", r"(dim|dimension).*(5|range)")
def _(env):
    return _net(env).aggregate(0, sbp.Real(), dims=(5,))


@clear("result.aggregate-dim-string", r"(dim|dims)")
def _(env):
    return _net(env).aggregate(0, sbp.Real(), dims=("hidden",))


@graceful(
    "result.aggregate-dim-int",
    lambda v, env: close(v, autograd(env.net(), (env.x,), out01).sum(-1)),
)
def _(env):
    """dims=-1 (an int, not a tuple)"""
    return _net(env).aggregate(0, sbp.Real(), dims=-1)


@graceful(
    "result.aggregate-real",
    lambda v, env: close(v, autograd(env.net(), (env.x,), out01).sum((0, 1))),
)
def _(env):
    return _net(env).aggregate(0, sbp.Real(), dims=(0, 1))


@graceful(
    "result.aggregate-max-vs-oracle",
    lambda v, env: close(
        v.hi,
        torch.from_numpy(oracles.build(_net(env)).readouts(_net(env).node(0), dims=(-1,))["hi"]),
    ),
)
def _(env):
    return _net(env).aggregate(0, sbp.MaxProduct(), dims=(-1,))


@graceful("result.max-vs-oracle", lambda r, env: max_matches_oracle(r, env))
def _(env):
    return _net(env)


@graceful(
    "result.top-path-value",
    lambda p, env: close(p.value, oracles.build(_net(env)).readouts(_net(env).node(0))["hi"][0, 2]),
)
def _(env):
    return _net(env).top_path((0, (0, 2)))


@graceful(
    "result.top-path-negative",
    lambda p, env: close(p.value, oracles.build(_net(env)).readouts(_net(env).node(0))["lo"][0, 2]),
)
def _(env):
    return _net(env).top_path((0, (0, 2)), sign="-")


def _oracle(env, place=0):
    res = _net(env)
    return oracles.build(res).readouts(res.node(place))


@graceful(
    "result.top-path-negative-index",
    lambda p, env: close(p.value, _oracle(env)["hi"][0, -1]),
)
def _(env):
    return _net(env).top_path((0, (0, -1)))


@graceful(
    "result.top-path-a-slice",
    lambda p, env: close(p.value, _oracle(env)["hi"][0].max()),
)
def _(env):
    """a set of sources (a slice): the path starts at the best of them"""
    return _net(env).top_path((0, (0, slice(None))))


@graceful(
    "result.top-path-from-a-module",
    lambda p, env: close(p.value, _oracle(env, "fc1")["hi"][0, 1]),
)
def _(env):
    return _net(env).top_path(("fc1", (0, 1)))


@clear("result.top-path-index-a-word", r"index \('a',\)")
def _(env):
    return _net(env).top_path((0, "a"))


@clear("result.at-a-tuple", r"\(0, 1\)")
def _(env):
    return _net(env).at((0, 1), sbp.Real())


@clear("result.aggregate-dim-twice", r"twice")
def _(env):
    return _net(env).aggregate(0, sbp.Real(), dims=(1, -1))


@graceful(
    "result.aggregate-no-dims",
    lambda v, env: close(v, autograd(env.net(), (env.x,), out01)),
)
def _(env):
    """dims=(): the ⊕ over no dimension is the value itself"""
    return _net(env).aggregate(0, sbp.Real(), dims=())


@clear("result.top-path-index-out-of-range", r"(index|out of range|size|bounds).*(9|4)")
def _(env):
    return _net(env).top_path((0, (0, 9)))


@clear("result.top-path-too-many-indices", r"(index|indices|dimension)")
def _(env):
    return _net(env).top_path((0, (0, 1, 2)))


@clear("result.top-path-bad-sign", r"sign")
def _(env):
    return _net(env).top_path(0, sign="x")


@clear("result.top-path-real", r"(Real|MaxProduct)")
def _(env):
    """top path asked of the Real semiring, which has no back-pointers"""
    return _net(env).top_path(0, sbp.Real())


@clear("result.top-path-not-computed", r"MaxAbs.*(not computed|computed)")
def _(env):
    return _net(env).top_path(0, sbp.MaxAbs())


@clear("result.top-path-unknown-place", r"no input, module or node named 'fc9'")
def _(env):
    return _net(env).top_path("fc9")


@clear("result.top-path-kept-only", r"keep")
def _(env):
    return sbp.Backprop(env.net(), out01, semirings=[sbp.MaxProduct()], keep=(0,))(env.x).top_path(
        0
    )


@graceful(
    "result.top-paths",
    lambda ps, env: close(
        sorted(abs(p.value) for p in ps),
        sorted(abs(oracles.build(_net(env)).readouts(_net(env).node(0), k=2)["topk"][0, 1])),
    ),
)
def _(env):
    return _net(env).top_paths((0, (0, 1)), 2)


@clear("result.top-paths-k-zero", r"(k|paths).*(0|at least|positive)")
def _(env):
    return _net(env).top_paths(0, 0)


@clear("result.top-paths-k-too-large", r"TopK\(5\)")
def _(env):
    return _net(env).top_paths(0, 5)


@clear("result.top-paths-k-string", r"(k|'2'|int)")
def _(env):
    return _net(env).top_paths(0, "2")


@clear("result.top-paths-without-topk", r"TopK")
def _(env):
    return sbp.backprop(env.net(), (env.x,), output=out01, semirings=[sbp.MaxProduct()]).top_paths(
        0, 2
    )


@clear("result.branches-unknown-place", r"no input, module or node named 'fc9'")
def _(env):
    return _net(env).branches("fc9")


@clear("result.branches-not-computed", r"(Entropy|not computed)")
def _(env):
    return _net(env).branches(0, sbp.Entropy())


@clear("result.branches-bad-aggregate", r"aggregate.*(oplus|bucket_sum)")
def _(env):
    return _net(env).branches(0, aggregate="bogus")


@clear("result.branches-bad-by", r"by.*(consumer|role)")
def _(env):
    return _net(env).branches(0, by="bogus")


@clear("result.branches-bad-roles", r"roles")
def _(env):
    return _net(env).branches(0, roles=42)


@clear("result.branches-bucket-sum-entropy", r"(bucket_sum|selective)")
def _(env):
    return env.bert_result().branches("embeddings", sbp.Entropy(), aggregate="bucket_sum")


@clear("result.branches-integer-ids", r"(int64|no edges|ids)")
def _(env):
    return env.bert_result().branches("input_ids", sbp.MaxProduct())


@graceful(
    "result.branches-real-sum",
    lambda t, env: close(
        sorted(t.groupby("token").value.sum().tolist())[:1],
        sorted(_bert_hidden_grad(env).sum(-1)[0].tolist())[:1],
        1e-4,
    ),
)
def _(env):
    """Real branches at the embeddings: per token, the branches add up to the gradient"""
    return env.bert_result().branches("embeddings", sbp.Real())


def _bert_hidden_grad(env):
    return _bert_embedding_grad_of(
        env, torch.tensor([[2, 5, 6, 7, 4, 3]]), lambda o: o.last_hidden_state[0, 4].sum()
    )


def _bert_embedding_grad_of(env, ids, output):
    bert, held = env.bert(), {}

    def hook(m, i, o):
        o.retain_grad()
        held["o"] = o

    h = bert.embeddings.register_forward_hook(hook)
    try:
        output(bert(input_ids=ids)).backward()
    finally:
        h.remove()
        bert.zero_grad(set_to_none=True)
    return held["o"].grad


@graceful(
    "result.layer-table",
    lambda t, env: (
        set(t.branch) >= {"skip", "query", "key", "value"}
        and close(
            sorted(
                t[(t.semiring == "Real") & (t.layer == 0) & (t.sublayer == "attention")]
                .groupby("token")
                .value.sum()
                .tolist()
            ),
            sorted(_bert_hidden_grad(env).sum(-1)[0].tolist()),
            1e-4,
        )
    ),
)
def _(env):
    """Real branches of layer 0's attention block add up to the gradient at its input"""
    return env.bert_result().layer_table(semirings=[sbp.Real()])


@clear("result.layer-table-no-attention", r"(attention|block|layer)")
def _(env):
    """a model without attention blocks"""
    return _net(env).layer_table()


@clear("result.layer-table-tokens-wrong-length", r"tokens.*(6|length)")
def _(env):
    return env.bert_result().layer_table(tokens=["a", "b"])


@clear("result.layer-table-bad-sublayer", r"(sublayer|bogus)")
def _(env):
    return env.bert_result().layer_table(sublayers=("bogus",))


@clear("result.layer-table-not-computed", r"(TopK|not computed)")
def _(env):
    return env.bert_result().layer_table(semirings=[sbp.TopK(2)])


@clear("result.layer-table-kept-only", r"keep")
def _(env):
    return sbp.Backprop(env.net(), out01, keep=(0,))(env.x).layer_table()


@clear("result.top-path-after-weights-changed", r"changed after the pass")
def _(env):
    """weights changed after the pass, then a path read from the result (read again from
    checkpoints): the path must be the one of the pass, or refused"""
    net = env.net()
    res = sbp.backprop(net, (env.x,), output=out01, semirings=[sbp.MaxProduct()])
    want = float(oracles.build(res).readouts(res.node(0))["hi"][0, 2])
    net.fc1.weight.data.mul_(3)
    path = res.top_path((0, (0, 2)))
    return path if abs(path.value - want) > 1e-6 else None  # the pass's own path: not silent


# =====================================================================================
# Data readers


def _write(env, name, content) -> Path:
    p = env.tmp("data") / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


def _blimp_line(ascii=True, **over):
    row = {
        "sentence_good": "the keys to the cabinet are here",
        "sentence_bad": "the keys to the cabinet is here",
        "one_prefix_prefix": "the keys to the cabinet",
        "one_prefix_word_good": "are",
        "one_prefix_word_bad": "is",
        "subject": 1,
        "attractors": [4],
    }
    row.update(over)
    return json.dumps({k: v for k, v in row.items() if v is not ...}, ensure_ascii=ascii)


LINZEN = "1\tthe keys to the cabinet are here\tthe keys to the cabinet ***mask*** here\tare\tis"


def _is_keys_example(exs, env, n=1):
    if len(exs) != n:
        return f"{len(exs)} examples, expected {n}"
    ex = exs[0]
    want = ("the", "keys", "to", "the", "cabinet", "***mask***", "here")
    if ex.words != want or ex.mask_index != 5 or (ex.good, ex.bad) != ("are", "is"):
        return f"read as {ex}"
    return True


def _read(fn_name, name, content):
    def run(env):
        from semiring_backprop import data

        return getattr(data, fn_name)(_write(env, name, content))

    return run


def data_clear(name, fn, file, content, names):
    case(f"data.{name}", "clear", names=names)(_read(fn, file, content))


def data_graceful(name, fn, file, content, check=_is_keys_example):
    case(f"data.{name}", "graceful", check=check)(_read(fn, file, content))


def data_skipped(name, fn, file, content, names):
    """A good line and a bad one: the bad one is skipped and reported in ``.skipped``
    with file:line and what is wrong (graceful); with ``strict=True``, an error."""

    def reported(exs, env):
        ok = _is_keys_example(exs, env)
        said = [f"{m.source}: {m.reason}" for m in getattr(exs, "skipped", ())]
        if ok is True and not any(re.search(names, m) for m in said):
            ok = f"the bad line is not reported as /{names}/: skipped={said}"
        return ok

    case(f"data.{name}", "graceful", check=reported)(_read(fn, file, content))

    def strict(env):
        from semiring_backprop import data

        return getattr(data, fn)(_write(env, file, content), strict=True)

    case(f"data.{name}-strict", "clear", names=names)(strict)


_empty = lambda exs, env: exs == [] or f"{exs}"  # noqa: E731
data_graceful("blimp-empty", "read_blimp", "e.jsonl", "", _empty)
data_graceful("linzen-empty", "read_linzen", "e.tsv", "", _empty)
data_graceful("blimp-blank-lines", "read_blimp", "b.jsonl", "\n\n  \n", _empty)
data_graceful("blimp-ok", "read_blimp", "ok.jsonl", _blimp_line() + "\n")
data_graceful("linzen-ok", "read_linzen", "ok.tsv", LINZEN + "\n")
data_graceful("blimp-crlf", "read_blimp", "crlf.jsonl", _blimp_line() + "\r\n")
data_graceful("linzen-crlf", "read_linzen", "crlf.tsv", LINZEN + "\r\n")
data_graceful("blimp-bom", "read_blimp", "bom.jsonl", "\ufeff" + _blimp_line() + "\n")
data_graceful("linzen-bom", "read_linzen", "bom.tsv", "\ufeff" + LINZEN + "\n")
data_graceful("blimp-trailing-blank-lines", "read_blimp", "t.jsonl", _blimp_line() + "\n\n\n")
data_graceful("linzen-trailing-blank-lines", "read_linzen", "t.tsv", LINZEN + "\n\n \n")
data_graceful("linzen-no-final-newline", "read_linzen", "n.tsv", LINZEN)
data_graceful("agreement-uppercase-extension", "read_agreement", "UP.JSONL", _blimp_line())
data_graceful("agreement-tsv", "read_agreement", "a.tsv", LINZEN)
data_graceful("agreement-txt", "read_agreement", "a.txt", LINZEN)
data_graceful(
    "blimp-punctuation",
    "read_blimp",
    "p.jsonl",
    _blimp_line(
        sentence_good="the keys to the cabinet are.", sentence_bad="the keys to the cabinet is."
    ),
    lambda exs, env: exs[0].words[-1] == "." or f"{exs[0].words}",
)
data_clear("blimp-binary", "read_blimp", "x.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00", r"x\.jsonl:1")
data_clear("linzen-binary", "read_linzen", "x.tsv", bytes(range(256)), r"x\.tsv:1")
data_clear(
    "blimp-latin1",
    "read_blimp",
    "l.jsonl",
    _blimp_line(sentence_good="caf\xe9", ascii=False).encode("latin-1"),
    r"l\.jsonl:1.*UTF-8",
)
data_clear(
    "linzen-latin1",
    "read_linzen",
    "l.tsv",
    ("2\tcaf\xe9" + LINZEN[1:]).encode("latin-1"),
    r"l\.tsv:1.*UTF-8",
)
data_clear("linzen-utf16", "read_linzen", "u16.tsv", LINZEN.encode("utf-16"), r"u16\.tsv:1")
data_clear("blimp-nul", "read_blimp", "z.jsonl", _blimp_line() + "\x00\n", r"z\.jsonl:1.*NUL")
data_skipped(
    "blimp-invalid-json",
    "read_blimp",
    "j.jsonl",
    _blimp_line() + "\n{oops\n",
    r"j\.jsonl:2.*not valid JSON",
)
data_clear("blimp-array", "read_blimp", "a.jsonl", "[1, 2]\n", r"a\.jsonl:1.*JSON object")
data_clear("blimp-string", "read_blimp", "s.jsonl", '"hello"\n', r"s\.jsonl:1.*JSON object")
data_clear("blimp-deep", "read_blimp", "d.jsonl", "[" * 100000 + "]" * 100000 + "\n", r"d\.jsonl:1")
data_clear(
    "blimp-missing-key",
    "read_blimp",
    "m.jsonl",
    _blimp_line(one_prefix_word_bad=...),
    r"m\.jsonl:1.*one_prefix_word_bad",
)
data_clear(
    "blimp-number-value",
    "read_blimp",
    "n.jsonl",
    _blimp_line(one_prefix_word_good=3),
    r"n\.jsonl:1.*one_prefix_word_good",
)
data_clear(
    "blimp-prefix-mismatch",
    "read_blimp",
    "pm.jsonl",
    _blimp_line(one_prefix_prefix="a dog"),
    r"pm\.jsonl:1.*does not start",
)
data_clear(
    "blimp-verb-two-words",
    "read_blimp",
    "v2.jsonl",
    _blimp_line(one_prefix_word_good="are not"),
    r"v2\.jsonl:1.*one word",
)
data_clear(
    "blimp-subject-out-of-range",
    "read_blimp",
    "so.jsonl",
    _blimp_line(subject=40),
    r"so\.jsonl:1.*subject.*40",
)
data_clear(
    "blimp-subject-negative",
    "read_blimp",
    "sn.jsonl",
    _blimp_line(subject=-1),
    r"sn\.jsonl:1.*subject.*-1",
)
data_clear(
    "blimp-subject-bool",
    "read_blimp",
    "sb.jsonl",
    _blimp_line(subject=True),
    r"sb\.jsonl:1.*subject.*True",
)
data_clear(
    "blimp-subject-float",
    "read_blimp",
    "sf.jsonl",
    _blimp_line(subject=1.0),
    r"sf\.jsonl:1.*subject.*1\.0",
)
data_clear(
    "blimp-subject-string",
    "read_blimp",
    "ss.jsonl",
    _blimp_line(subject="keys"),
    r"ss\.jsonl:1.*subject.*keys",
)
data_clear(
    "blimp-subject-at-verb",
    "read_blimp",
    "sv.jsonl",
    _blimp_line(subject=5),
    r"sv\.jsonl:1.*subject 5.*verb",
)
data_clear(
    "blimp-attractors-not-list",
    "read_blimp",
    "an.jsonl",
    _blimp_line(attractors=4),
    r"an\.jsonl:1.*attractors.*list",
)
data_clear(
    "blimp-attractor-twice",
    "read_blimp",
    "at.jsonl",
    _blimp_line(attractors=[4, 4]),
    r"at\.jsonl:1.*more than once",
)
data_clear(
    "blimp-attractor-at-verb",
    "read_blimp",
    "av.jsonl",
    _blimp_line(attractors=[5]),
    r"av\.jsonl:1.*verb",
)
data_clear(
    "blimp-attractor-is-subject",
    "read_blimp",
    "as.jsonl",
    _blimp_line(attractors=[1]),
    r"as\.jsonl:1.*subject",
)
data_clear(
    "blimp-attractor-out-of-range",
    "read_blimp",
    "ao.jsonl",
    _blimp_line(attractors=[99]),
    r"ao\.jsonl:1.*attractors.*99",
)
data_skipped(
    "blimp-second-line-bad",
    "read_blimp",
    "l2.jsonl",
    _blimp_line() + "\n" + _blimp_line(subject=99) + "\n",
    r"l2\.jsonl:2",
)
data_clear(
    "linzen-four-columns",
    "read_linzen",
    "c4.tsv",
    LINZEN.rsplit("\t", 1)[0],
    r"c4\.tsv:1.*5 tab-separated columns.*found 4",
)
data_clear("linzen-six-columns", "read_linzen", "c6.tsv", LINZEN + "\textra", r"c6\.tsv:1.*found 6")
data_clear(
    "linzen-spaces-not-tabs",
    "read_linzen",
    "sp.tsv",
    LINZEN.replace("\t", "    "),
    r"sp\.tsv:1.*tab-separated.*found 1",
)
data_clear(
    "linzen-count-word",
    "read_linzen",
    "cw.tsv",
    "two" + LINZEN[1:],
    r"cw\.tsv:1.*number of attractors.*'two'",
)
data_clear("linzen-count-negative", "read_linzen", "cn.tsv", "-1" + LINZEN[1:], r"cn\.tsv:1.*'-1'")
data_clear(
    "linzen-no-mask",
    "read_linzen",
    "nm.tsv",
    LINZEN.replace("***mask***", "are"),
    r"nm\.tsv:1.*\*\*\*mask\*\*\*",
)
data_clear(
    "linzen-two-masks",
    "read_linzen",
    "tm.tsv",
    LINZEN.replace("the cabinet ***mask***", "***mask*** cabinet ***mask***"),
    r"tm\.tsv:1.*exactly once",
)
data_clear(
    "linzen-mask-glued",
    "read_linzen",
    "mg.tsv",
    LINZEN.replace("cabinet ***mask***", "cabinet***mask***"),
    r"mg\.tsv:1.*word of its own",
)
data_clear(
    "linzen-columns-differ",
    "read_linzen",
    "cd.tsv",
    LINZEN.replace("the keys to the cabinet are", "a dog near the cabinet are"),
    r"cd\.tsv:1.*differ",
)
data_clear(
    "linzen-empty-verb",
    "read_linzen",
    "ev.tsv",
    LINZEN.rsplit("\t", 1)[0] + "\t",
    r"ev\.tsv:1.*column 5",
)
data_skipped(
    "linzen-header-line",
    "read_linzen",
    "h.tsv",
    "count\tsentence\tmasked\tgood\tbad\n" + LINZEN,
    r"h\.tsv:1.*'count'",
)


@clear("data.missing-file", r"no-such\.tsv.*does not exist")
def _(env):
    from semiring_backprop import data

    return data.read_linzen(env.root / "no-such.tsv")


@clear("data.directory", r"does not exist or is not a file")
def _(env):
    from semiring_backprop import data

    return data.read_blimp(env.tmp("data"))


@clear("data.unknown-extension", r"\.csv.*jsonl.*tsv")
def _(env):
    from semiring_backprop import data

    return data.read_agreement(_write(env, "a.csv", LINZEN))


@clear("data.no-extension", r"extension")
def _(env):
    from semiring_backprop import data

    return data.read_agreement(_write(env, "noext", LINZEN))


# =====================================================================================
# Experiment run directories (the library's own resumable files)


def _common():
    from semiring_backprop.runner import records as common

    return common


def _records_file(env, name, text):
    p = env.tmp("records") / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def _rows(rec, env, keys):
    got = [r.get("key") for r in rec.rows]
    if got != keys:
        return f"rows {got}, expected {keys}"
    text = rec.path.read_text()
    if text != "".join(json.dumps({"key": k}) + "\n" for k in keys):
        return f"file reads {text!r}"
    return True


@graceful("runs.records-ok", lambda r, env: _rows(r, env, [0, 1]))
def _(env):
    return _common().Records(_records_file(env, "ok.jsonl", '{"key": 0}\n{"key": 1}\n'))


@graceful("runs.records-no-final-newline", lambda r, env: _rows(r, env, [0, 1, 2]))
def _(env):
    rec = _common().Records(_records_file(env, "nl.jsonl", '{"key": 0}\n{"key": 1}'))
    rec.add({"key": 2})
    return _common().Records(rec.path)


@graceful("runs.records-cut-off-last-line", lambda r, env: _rows(r, env, [0]))
def _(env):
    return _common().Records(_records_file(env, "cut.jsonl", '{"key": 0}\n{"key": 1, "va'))


@graceful("runs.records-empty-file", lambda r, env: _rows(r, env, []))
def _(env):
    return _common().Records(_records_file(env, "empty.jsonl", ""))


@graceful("runs.records-crlf", lambda r, env: [x["key"] for x in r.rows] == [0, 1] or f"{r.rows}")
def _(env):
    return _common().Records(_records_file(env, "crlf.jsonl", '{"key": 0}\r\n{"key": 1}\r\n'))


@clear("runs.records-corrupt-middle-line", r"bad\.jsonl:2.*not valid JSON")
def _(env):
    return _common().Records(_records_file(env, "bad.jsonl", '{"key": 0}\n{oops\n{"key": 2}\n'))


@clear("runs.records-binary", r"bin\.jsonl")
def _(env):
    return _common().Records(_records_file(env, "bin.jsonl", b"\x80\x81\xfe\xff\x00\n"))


@clear("runs.records-not-objects", r"arr\.jsonl:1")
def _(env):
    return _common().Records(_records_file(env, "arr.jsonl", "[1, 2]\n"))


@graceful("runs.records-duplicate-row", lambda r, env: _rows_keys(r, [0, 1]))
def _(env):
    """the same row twice (appended by two runs): read once"""
    return _common().Records(
        _records_file(env, "dup.jsonl", '{"key": 0}\n{"key": 1}\n{"key": 0}\n')
    )


def _rows_keys(rec, keys):
    got = [r.get("key") for r in rec.rows]
    if got != keys:
        return f"rows {got}, expected {keys} (duplicated data)"
    frame_keys = rec.frame()["key"].tolist()
    return frame_keys == keys or f"frame keys {frame_keys}, expected {keys}"


@clear("runs.records-conflicting-rows", r"clash\.jsonl.*key 0")
def _(env):
    """two different rows for one key: which one holds is unknown"""
    return _common().Records(
        _records_file(env, "clash.jsonl", '{"key": 0, "v": 1}\n{"key": 0, "v": 2}\n')
    )


@dataclass(frozen=True)
class _Cfg:
    seed: int = 0
    size: int = 4


def _settings_dir(env, name, config_text, results=True):
    d = env.tmp("settings") / name
    d.mkdir(parents=True, exist_ok=True)
    if config_text is not None:
        (d / "config.json").write_bytes(
            config_text if isinstance(config_text, bytes) else config_text.encode()
        )
    if results:
        (d / "values.jsonl").write_text('{"key": 0}\n')
    return d


@clear("runs.settings-other", r"other settings \(seed\)")
def _(env):
    d = _settings_dir(env, "other", json.dumps({"seed": 1, "size": 4}))
    return _common().same_settings(d, _Cfg())


@graceful(
    "runs.settings-other-no-results",
    lambda d, env: json.loads((d / "config.json").read_text()) == {"seed": 0, "size": 4},
)
def _(env):
    """a failed run's config.json (no results) does not block a corrected rerun"""
    d = _settings_dir(env, "failed", json.dumps({"seed": 1, "size": 4}), results=False)
    _common().same_settings(d, _Cfg())
    return d


@clear("runs.settings-corrupt-config", r"config\.json is not valid JSON")
def _(env):
    return _common().same_settings(_settings_dir(env, "corrupt", '{"seed": '), _Cfg())


@clear("runs.settings-binary-config", r"config\.json")
def _(env):
    return _common().same_settings(_settings_dir(env, "binary", b"\xff\xfe\x00"), _Cfg())


@clear("runs.settings-config-not-object", r"config\.json")
def _(env):
    """config.json holds a list: the settings of the results beside it are unknown"""
    return _common().same_settings(_settings_dir(env, "list", "[1, 2]"), _Cfg())


@graceful(
    "runs.settings-same",
    lambda d, env: json.loads((d / "config.json").read_text()) == {"seed": 0, "size": 4},
)
def _(env):
    d = _settings_dir(env, "same", json.dumps({"seed": 0, "size": 4}))
    _common().same_settings(d, _Cfg())
    return d


@clear("runs.lock-held", r"in use by another run \(process \d+\)")
def _(env):
    common = _common()
    out = env.tmp("locks") / "held"
    with common.lock(out), common.lock(out):
        pass


@clear("runs.lock-under-a-file", r"cannot write into output directory")
def _(env):
    f = env.tmp("locks") / "file"
    f.write_text("x")
    with _common().lock(f / "out"):
        pass


@clear("runs.lock-out-is-a-file", r"cannot write into output directory")
def _(env):
    f = env.tmp("locks") / "plainfile"
    f.write_text("x")
    with _common().lock(f):
        pass


@graceful("runs.lock-stale-file", lambda pid, env: pid == str(os.getpid()) or pid)
def _(env):
    """a .lock left by a process that died: taken over"""
    out = env.tmp("locks") / "stale"
    out.mkdir()
    (out / ".lock").write_text("999999")
    with _common().lock(out):
        return (out / ".lock").read_text()


def _trained(env, name, spoil):
    from semiring_backprop.experiments import common

    d = env.tmp("trained") / name
    fits = []

    def fit(model):
        fits.append(1)
        with torch.no_grad():
            model.weight.fill_(float(len(fits)))
        return [{"epoch": len(fits)}]

    common.trained(nn.Linear(2, 2), d, fit)
    spoil(d)
    logger = logging.getLogger(common.__name__)  # "cannot be read ...; training again"
    logger.disabled = True
    try:
        model, history = common.trained(nn.Linear(2, 2), d, fit)
    finally:
        logger.disabled = False
    return model, history, len(fits)


def _retrained(value, env):
    model, history, fits = value
    ok = fits == 2 and history == [{"epoch": 2}] and bool((model.weight == 2).all())
    return ok or f"fits={fits} history={history}"


@graceful("runs.trained-cut-model", _retrained)
def _(env):
    return _trained(
        env, "cut", lambda d: (d / "model.pt").write_bytes((d / "model.pt").read_bytes()[:50])
    )


@graceful("runs.trained-corrupt-history", _retrained)
def _(env):
    return _trained(env, "hist", lambda d: (d / "history.json").write_text('[{"epoch": '))


@graceful("runs.trained-other-architecture", _retrained)
def _(env):
    return _trained(env, "arch", lambda d: torch.save(nn.Linear(3, 5).state_dict(), d / "model.pt"))


@graceful(
    "runs.trained-reused",
    lambda v, env: (v[2] == 1 and bool((v[0].weight == 1).all())) or f"fits={v[2]}",
)
def _(env):
    return _trained(env, "reuse", lambda d: None)


@graceful(
    "runs.atomic-write-interrupted",
    lambda p, env: (
        (
            json.loads(p.read_text()) == {"a": 1}
            and [q.name for q in p.parent.iterdir()] == ["s.json"]
        )
        or "lost"
    ),
)
def _(env):
    common = _common()
    d = env.tmp("atomic")
    path = common.write_json(d / "s.json", {"a": 1})

    def half(tmp):
        tmp.write_text('{"a": ')
        raise KeyboardInterrupt

    with contextlib.suppress(KeyboardInterrupt):
        from semiring_backprop._files import atomic_write

        atomic_write(path, half)
    return path


@graceful(
    "runs.write-json-nan", lambda p, env: json.loads(p.read_text()) == {"a": None, "b": [1.0, None]}
)
def _(env):
    """NaN and inf in a summary become null (reported as missing), never invalid JSON"""
    return _common().write_json(env.tmp("nan") / "s.json", {"a": math.nan, "b": [1.0, -math.inf]})


# =====================================================================================
# Command line (each in a child process)


def cli(name, expect="clear", names="", check=None):
    def add(fn):
        return case(f"cli.{name}", expect, names=names, check=check, what=(fn.__doc__ or ""))(
            lambda env: fn(env)
        )

    return add


def explain_argv(model, text=TEXT, target="are", foil="is", *extra):
    return ["explain", str(model), "--text", text, "--target", target, "--foil", foil, *extra]


def _dir(env, name):
    return env.model_dirs()[name]


def _explain_case(name, model, *extra, names, text=TEXT, target="are", foil="is", hold=None):
    def run(env):
        m = env.model_dirs().get(model, model)
        return Cli(explain_argv(m, text, target, foil, *extra))

    case(f"cli.explain-{name}", "clear", names=names)(run)


_explain_case("missing-dir", "./no/such/dir", names=r"no such directory")
_explain_case("hub-id-offline", "no-such-org/no-such-model", names=r"no-such-org/no-such-model")
_explain_case("empty-dir", "empty", names=r"could not load")
# (no weights and no tokenizer: either is named first)
_explain_case("config-only", "config_only", names=r"(could not load|no tokenizer vocabulary)")
_explain_case("no-weights", "no_weights", names=r"could not load.*(weights|safetensors|bin)")
_explain_case("no-tokenizer", "no_tokenizer", names=r"(tokenizer|vocab)")
_explain_case("corrupt-config", "corrupt_config", names=r"config\.json")
_explain_case("config-a-list", "config_list", names=r"config\.json")
_explain_case("cut-weights", "cut_weights", names=r"(model\.safetensors|weights)")
_explain_case("garbage-weights", "garbage_weights", names=r"(model\.safetensors|weights)")
_explain_case("unknown-architecture", "unknown_type", names=r"no-such-architecture")
_explain_case("remote-code", "remote_code", names=r"code of its own")
_explain_case("classifier-checkpoint", "classifier", names=r"lacks the weights")
_explain_case(
    "mask-token-outside-vocab", "nomask", names=r"id 15 .*\[MASK\].*15 entries.*not this model's"
)
_explain_case("tokenizer-without-mask", "fast_nomask", names=r"no mask token")
_explain_case("target-not-in-vocab", "bert", target="zebra", names=r"'zebra' is not in")
_explain_case(
    "foil-pieces-too-long",
    "bert",
    foil="dogs",
    text=" ".join(["the"] * 13) + " [MASK]",
    names=r"17 tokens long.*at most 16",
)
_explain_case(
    "label-not-a-label", "classifier", "--task", "classification", target="happy",
    names=r"'happy' is not one of the model's 2 labels \(0: LABEL_0, 1: LABEL_1\)",
)  # fmt: skip
_explain_case("target-equals-foil", "bert", target="is", foil="is", names=r"same token")
_explain_case("target-empty", "bert", target="", names=r"''")
_explain_case(
    "text-without-mask",
    "bert",
    text="the keys to the cabinet are here",
    names=r"no \[MASK\] tokens",
)
_explain_case(
    "text-two-masks", "bert", text="the [MASK] to the cabinet [MASK]", names=r"2 \[MASK\] tokens"
)
_explain_case("text-empty", "bert", text="", names=r"(no tokens|no \[MASK\])")
_explain_case("text-too-long", "bert", text=" ".join(["the"] * 30) + " [MASK]", names=r"at most 16")
if not torch.cuda.is_available():  # (where there is one, tests/test_cuda.py explains on it)
    _explain_case("device-cuda", "bert", "--device", "cuda", names=r"no CUDA device")
_explain_case("device-bogus", "bert", "--device", "gpu0", names=r"'gpu0' is not a device")
_explain_case("device-cuda-index", "bert", "--device", "cuda:7", names=r"cuda:7")
_explain_case("device-meta", "bert", "--device", "meta", names=r"'meta' holds shapes only")
_explain_case("out-empty", "bert", "--out", "", names=r"--out: an empty name")
_explain_case("bad-semiring", "bert", "--semiring", "bogus", names=r"invalid choice: 'bogus'")
_explain_case("bad-granularity", "bert", "--granularity", "word", names=r"invalid choice: 'word'")
_explain_case("bad-dtype", "bert", "--dtype", "float16", names=r"invalid choice: 'float16'")
_explain_case("bad-kind", "bert", "--kind", "seq2seq", names=r"invalid choice: 'seq2seq'")


@cli("explain-similarity-no-pooling", names=r"says nothing about pooling.*give it, --pooling")
def _(env):
    """a masked LM's directory has no sentence-transformers pooling files"""
    argv = ["explain", str(_dir(env, "bert")), "--task", "similarity", "--text", "a dog",
            "--text-pair", "a cat"]  # fmt: skip
    return Cli(argv)


@cli("explain-option-of-another-task", names=r"--pooling does not apply to the lm task")
def _(env):
    return Cli(explain_argv(_dir(env, "bert"), TEXT, "are", "is", "--pooling", "mean"))


@cli("explain-missing-text", names=r"--text")
def _(env):
    return Cli(["explain", str(_dir(env, "bert")), "--target", "are", "--foil", "is"])


@cli("explain-no-model", names=r"(model|arguments are required)")
def _(env):
    return Cli(["explain"])


@cli("explain-out-under-a-file", names=r"(out|cannot write|Not a directory)")
def _(env):
    """--out names a directory inside a plain file"""
    f = env.tmp("cli") / "plain"
    f.write_text("x")
    return Cli(explain_argv(_dir(env, "bert"), TEXT, "are", "is", "--out", str(f / "out")))


@cli("explain-out-is-a-file", names=r"(out|cannot write|exists)")
def _(env):
    f = env.tmp("cli") / "plain2"
    f.write_text("x")
    return Cli(explain_argv(_dir(env, "bert"), TEXT, "are", "is", "--out", str(f)))


def _explained(ran, env):
    """Exit 0; the printed score is log p(are) - log p(is) from the model's own logits;
    explanation.json says the same."""
    m = re.search(r"= (-?\d+\.\d+)", ran.out)
    if not m:
        return f"no score printed: {ran.out[-500:]}"
    want = _cli_score(env)
    if abs(float(m.group(1)) - want) > 1e-3:
        return f"score {m.group(1)} != {want:.4f} (from the model's logits)"
    files = env.tmp("cli-ok") / "out" / "explanation.json"
    if not files.exists():
        return True
    saved = json.loads(files.read_text())["score"]
    return abs(saved - want) < 1e-4 or f"explanation.json score {saved} != {want}"


@cli("explain-ok", "graceful", check=_explained)
def _(env):
    """a correct run, writing its files (the oracle is the model's own score)"""
    return Cli(
        explain_argv(_dir(env, "bert"), TEXT, "are", "is", "--out", str(env.tmp("cli-ok") / "out"))
    )


@cli("explain-text-with-crlf", "graceful", check=_explained)
def _(env):
    """the text pasted with a Windows line end and extra spaces"""
    return Cli(
        explain_argv(
            _dir(env, "bert"),
            "  the keys to the cabinet [MASK] on the table \r\n",
            "are",
            "is",
            "--semiring",
            "real",
        )
    )


@cli("no-command", "graceful", check=lambda r, env: "quickstart" in r.out or r.out[-300:])
def _(env):
    """no sub-command: the quickstart runs"""
    return Cli([])


@cli("unknown-command", names=r"invalid choice: 'bogus'")
def _(env):
    return Cli(["bogus"])


@cli("help", "graceful", check=lambda r, env: "explain" in r.out and "experiment" in r.out)
def _(env):
    return Cli(["--help"])


def _quickstart_json(ran, env, seed=0):
    """Every token's |grad| is the norm of torch.autograd's gradient at the embeddings."""
    from semiring_backprop.quickstart import TinyClassifier

    rows = json.loads(ran.out)["rows"]
    torch.manual_seed(seed)
    model = TinyClassifier().double().eval()
    ids = torch.tensor([[3, 7, 1, 3, 9, 4]])
    emb = model.embed(ids).detach().requires_grad_()
    (g,) = torch.autograd.grad(model.head(model.encoder(emb)[:, 0])[0, 1], emb)
    return close([r["grad_norm"] for r in rows], g[0].norm(dim=-1), 1e-6)


@cli("quickstart-json", "graceful", check=_quickstart_json)
def _(env):
    return Cli(["quickstart", "--json"])


@cli("quickstart-negative-seed", "graceful", check=lambda r, env: _quickstart_json(r, env, -1))
def _(env):
    return Cli(["quickstart", "--json", "--seed", "-1"])


@cli("quickstart-seed-word", names=r"--seed.*invalid int value: 'abc'")
def _(env):
    return Cli(["quickstart", "--seed", "abc"])


@cli("quickstart-seed-huge", names=r"(seed|99999999999999999999999)")
def _(env):
    return Cli(["quickstart", "--seed", "99999999999999999999999"])


@cli("ops", "graceful", check=lambda r, env: _ops_listed(r.out))
def _(env):
    return Cli(["ops"])


def _ops_listed(out):
    """Every listed op is a real ATen overload, and mm is among them."""
    names = [line.split()[-1] for line in out.splitlines() if line and not line.startswith("(")]
    for name in names:
        ns, op, overload = name.split(".")
        if not hasattr(getattr(torch.ops, ns), op):
            return f"{name} is not an op"
    return "aten.mm.default" in names or "aten.mm.default not listed"


@cli("ops-extra-argument", names=r"unrecognized arguments: --json")
def _(env):
    return Cli(["ops", "--json"])


@cli("experiment-unknown", names=r"invalid choice: 'bogus'")
def _(env):
    return Cli(["experiment", "bogus"])


@cli("experiment-no-name", names=r"(name|required)")
def _(env):
    return Cli(["experiment"])


def _set_case(label, exp, setting, names, *more):
    def run(env):
        out = env.tmp("cli-set") / label
        return Cli(
            ["experiment", exp, "--quick", "--out", str(out), "--set", *setting.split(" "), *more]
        )

    case(f"cli.set-{label}", "clear", names=names)(run)


_set_case("no-equals", "sva", "limit", r"--set 'limit': expected KEY=VALUE")
_set_case("unknown-key", "sva", "heads=2", r"--set 'heads=2'.*bert_heads")
_set_case("limit-word", "sva", "limit=abc", r"limit")
_set_case("limit-zero", "sva", "limit=0", r"limit")
_set_case("limit-negative", "sva", "limit=-3", r"limit")
_set_case("synthetic-zero", "sva", "synthetic=0", r"synthetic")
_set_case("seed-negative", "sva", "seed=-1", r"seed")
_set_case("seed-float", "sva", "seed=1.5", r"seed")
_set_case("bins-decreasing", "sva", "length_bins=10,5", r"length_bins")
_set_case("bins-words", "sva", "length_bins=a,b", r"length_bins")
_set_case("aggregation-bogus", "sva", "aggregation=mean", r"aggregation")
_set_case("granularity-bogus", "sva", "granularity=word", r"granularity")
_set_case("batch-zero", "sva", "batch_size=0", r"batch_size=0")
_set_case("workers-negative", "sva", "workers=-2", r"workers=-2")
_set_case("heads-divide", "sva", "bert_hidden=10 bert_heads=3", r"bert_hidden=10.*bert_heads=3")
_set_case("heads-zero", "sva", "bert_heads=0", r"bert_heads")
_set_case("hidden-negative", "sva", "bert_hidden=-8", r"bert_hidden")
_set_case("layers-huge-word", "sva", "bert_layers=1e3", r"bert_layers")
_set_case("ftr-epochs-zero", "first-token-repeated", "max_epochs=0", r"max_epochs")
_set_case("ftr-heads-zero", "first-token-repeated", "heads=0", r"heads")
_set_case("ftr-explain-batch-zero", "first-token-repeated", "explain_batch=0", r"explain_batch")
_set_case("ftr-explain-limit-word", "first-token-repeated", "explain_limit=abc", r"explain_limit")
_set_case("ftr-lr-nan", "first-token-repeated", "lr=nan", r"lr")
_set_case("ftr-lr-inf", "first-token-repeated", "lr=inf", r"lr")
_set_case("ftr-lr-negative", "first-token-repeated", "lr=-0.1", r"lr")
_set_case("ftr-seeds-empty", "first-token-repeated", "seeds=", r"seeds")
_set_case("ftr-min-accuracy", "first-token-repeated", "min_accuracy=2", r"min_accuracy")
_set_case("mdl-fractions", "entropy-vs-mdl", "mdl_fractions=0,2", r"mdl_fractions")
_set_case("bool-word", "entropy-sanity", "quick=maybe", r"quick")


def _sva_data_case(label, file, content, names):
    def run(env):
        data = env.tmp("cli-sva-data") / file
        data.write_bytes(content if isinstance(content, bytes) else content.encode())
        out = env.tmp("cli-sva") / label
        return Cli(["experiment", "sva", "--quick", "--out", str(out), "--set", f"data={data}"])

    case(f"cli.sva-data-{label}", "clear", names=names)(run)


_sva_data_case("empty", "empty.jsonl", "", r"empty\.jsonl: no examples")
_sva_data_case("blank", "blank.tsv", "\n\n", r"blank\.tsv: no examples")
_sva_data_case("binary", "bin.jsonl", b"\x00\x01\x02\xff", r"bin\.jsonl:1")
_sva_data_case(
    "latin1", "l1.tsv", ("1\tcaf\xe9" + LINZEN[1:]).encode("latin-1"), r"l1\.tsv:1.*UTF-8"
)
_sva_data_case("columns", "cols.tsv", "1\tthe dog\tthe ***mask***\n", r"cols\.tsv:1.*columns")
_sva_data_case("csv", "data.csv", LINZEN, r"data\.csv.*extension")


@cli("sva-data-missing", names=r"no-such\.tsv.*does not exist")
def _(env):
    return Cli(
        [
            "experiment",
            "sva",
            "--quick",
            "--out",
            str(env.tmp("cli-sva") / "missing"),
            "--set",
            f"data={env.root / 'no-such.tsv'}",
        ]
    )


@cli("sva-model-missing", names=r"(no-such-model|could not load)")
def _(env):
    return Cli(
        [
            "experiment",
            "sva",
            "--quick",
            "--out",
            str(env.tmp("cli-sva") / "model"),
            "--set",
            f"model={env.root / 'no-such-model'}",
        ]
    )


@cli("sva-out-under-a-file", names=r"cannot write into output directory")
def _(env):
    f = env.tmp("cli-sva") / "plain"
    f.write_text("x")
    return Cli(["experiment", "sva", "--quick", "--out", str(f / "out")])


@cli("sva-out-held", names=r"in use by another run")
def _(env):
    out = env.tmp("cli-sva") / "held"
    return Cli(["experiment", "sva", "--quick", "--out", str(out)], hold=out)


@cli("sva-rerun-other-settings", names=r"other settings \(seed\)")
def _(env):
    """a rerun into a directory holding results of a run with another seed"""
    from semiring_backprop import experiments

    out = env.tmp("cli-sva") / "other"
    out.mkdir()
    cfg = experiments.config("sva", quick=True)
    (out / "config.json").write_text(
        json.dumps({**json.loads(json.dumps(_asdict(cfg))), "seed": 5})
    )
    (out / "examples.jsonl").write_text('{"key": 0}\n')
    return Cli(["experiment", "sva", "--quick", "--out", str(out)])


@cli("sva-corrupt-config", names=r"config\.json is not valid JSON")
def _(env):
    out = env.tmp("cli-sva") / "corrupt"
    out.mkdir()
    (out / "config.json").write_text('{"model": ')
    (out / "examples.jsonl").write_text('{"key": 0}\n')
    return Cli(["experiment", "sva", "--quick", "--out", str(out)])


def _asdict(cfg):
    import dataclasses

    return dataclasses.asdict(cfg)


@cli("demo-out-under-a-file", names=r"cannot write into output directory")
def _(env):
    f = env.tmp("cli-demo") / "plain"
    f.write_text("x")
    return Cli(["demo", "--out", str(f / "out")])


@cli("demo-out-held", names=r"in use by another run")
def _(env):
    out = env.tmp("cli-demo") / "held"
    return Cli(["demo", "--out", str(out)], hold=out)


@cli("demo-out-empty", names=r"--out: an empty name")
def _(env):
    """--out "" (an unset shell variable): not the current directory"""
    return Cli(["demo", "--out", ""])


@cli("experiment-out-empty", names=r"--out: an empty name")
def _(env):
    return Cli(["experiment", "sva", "--quick", "--out", ""])


@cli("sva-data-a-directory", names=r"cli-sva-dir'.*extension")
def _(env):
    """--set data= names a directory"""
    out = env.tmp("cli-sva") / "dir-data"
    return Cli(["experiment", "sva", "--quick", "--out", str(out), "--set",
                f"data={env.tmp('cli-sva-dir')}"])  # fmt: skip


@cli("demo-extra-argument", names=r"unrecognized arguments: --quick")
def _(env):
    return Cli(["demo", "--quick"])


# =====================================================================================
# Running and classifying


def _cli_child(argv, out, err, cwd):  # pragma: no cover  (runs in the child)
    fo = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    fe = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fo, 1)
    os.dup2(fe, 2)
    os.chdir(cwd)
    from semiring_backprop import cli as cli_module

    try:
        code = cli_module.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    use = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).with_name("cpu").write_text(str(use.ru_utime + use.ru_stime))
    Path(out).with_name("code").write_text(str(code or 0))
    os._exit(code or 0)


_PRELOAD = [
    "transformers.models.bert.modeling_bert",
    "transformers.models.bert.tokenization_bert",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "semiring_backprop.quickstart",
    "semiring_backprop.experiments.sva",
    "semiring_backprop.experiments.first_token",
    "pandas",
    "torch",
    "transformers",
    "semiring_backprop.cli",
    "semiring_backprop.hf.explain",
    "semiring_backprop.experiments",
]
_CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


def _context():
    """A forkserver that imported torch and transformers once, with the hub offline."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    from multiprocessing import forkserver

    before = {k: os.environ.get(k) for k in _CHILD_ENV}
    os.environ.update(_CHILD_ENV)  # the server (and so every child) starts with these
    try:
        forkserver.ensure_running()
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


_STARTING = threading.Lock()


def run_cli(command: Cli, env: Env, ctx) -> Ran:
    d = Path(tempfile.mkdtemp(dir=env.root))
    hold = _common().lock(command.hold) if command.hold else contextlib.nullcontext()
    with hold:
        p = ctx.Process(target=_cli_child, args=(command.argv, d / "out", d / "err", str(d)))
        with _STARTING:  # multiprocessing does not promise that threads may start at once
            p.start()
        p.join(CLI_TIMEOUT)
        if p.is_alive():
            p.kill()
            p.join()
            return Ran(-9, "", f"hung: killed after {CLI_TIMEOUT} s")
    read = lambda f: f.read_text(errors="replace") if f.exists() else ""  # noqa: E731
    code = p.exitcode  # negative: killed by that signal
    if code >= 0 and read(d / "code"):  # what the child itself said it exited with
        code = int(read(d / "code"))
    ran = Ran(code, read(d / "out"), read(d / "err"), float(read(d / "cpu") or 0))
    env.cpu += ran.cpu
    return ran


def _names(pattern, text):
    return re.search(pattern, text, re.IGNORECASE | re.DOTALL) is not None


def _checked(c: Case, value, env) -> Outcome:
    if c.check is None:
        shown = repr(value)[:300]
        return Outcome("silent", f"accepted without an error, returned {shown}")
    try:
        ok = c.check(value, env)
    except Exception:
        return Outcome("raw", "reading the result failed:\n" + traceback.format_exc(limit=-4))
    if ok is True:
        return Outcome("graceful", "checked against the oracle")
    return Outcome("silent", f"wrong result: {ok}")


def classify(c: Case, env: Env, ctx=None) -> Outcome:
    """Run case ``c`` and put what happened in one class."""
    started = env.started.pop(c.name, None)
    if started is not None:  # a command line started early by prefetch()
        return _classify_cli(c, started.result(), env)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = c.run(env)
        except SemiringBackpropError as e:
            text = f"{type(e).__name__}: {e}"
            if _names(c.names, str(e)):
                return Outcome("clear", text)
            return Outcome("raw", f"our error, but it does not name /{c.names}/: {text}")
        except Exception:
            return Outcome("raw", traceback.format_exc(limit=-6))
        if isinstance(value, Cli):
            return _classify_cli(c, run_cli(value, env, ctx or _context()), env)
        outcome = _checked(c, value, env)
    if caught and outcome.kind == "graceful":
        outcome.detail += "; warned: " + "; ".join(str(w.message)[:120] for w in caught)
    return outcome


def _classify_cli(c: Case, ran: Ran, env) -> Outcome:
    both = (ran.out + "\n" + ran.err).strip()
    tail = both[-1500:]
    if ran.code < 0:
        return Outcome("crash", f"killed by signal {-ran.code}: {tail}")
    if "Traceback (most recent call last)" in both:
        return Outcome("raw", f"exit {ran.code} with a traceback: {tail}")
    errors = [ln for ln in ran.err.splitlines() if "error:" in ln]
    if ran.code == 2 and errors:
        if _names(c.names, "\n".join(errors)):
            return Outcome("clear", errors[-1][:400])
        return Outcome("raw", f"an error line that does not name /{c.names}/: {errors[-1][:400]}")
    if ran.code == 0:
        return _checked(c, ran, env)
    return Outcome("raw", f"exit {ran.code}: {tail}")


@dataclass
class Report:
    outcomes: dict = field(default_factory=dict)  # case name -> Outcome
    times: dict = field(default_factory=dict)  # case name -> seconds
    seconds: float = 0.0
    cpu: tuple = (0.0, 0.0)  # CPU seconds: this process, the command-line children

    def counts(self) -> dict:
        counts = dict.fromkeys(CLASSES, 0)
        for o in self.outcomes.values():
            counts[o.kind] += 1
        return counts

    def table(self) -> str:
        c = self.counts()
        head = "| tried | clear error | graceful | raw traceback | crash | silent wrong or lost |"
        return "\n".join(
            [
                head,
                "|---|---|---|---|---|---|",
                f"| {len(self.outcomes)} | {c['clear']} | {c['graceful']} | {c['raw']} "
                f"| {c['crash']} | {c['silent']} |",
            ]
        )


def prefetch(cases, env: Env, ctx, workers: int = 2):
    """Start the command-line cases now, ``workers`` at a time (each in its own child
    process), while the library cases run in this process; :func:`classify` collects
    them. Returns the thread pool that waits on the children (shut it down after)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(workers, thread_name_prefix="battery-cli")
    for c in cases:
        if not c.name.startswith("cli."):
            continue
        try:
            command = c.run(env)
        except Exception:  # classify runs it again and reports what it raised
            continue
        if isinstance(command, Cli):
            env.started[c.name] = pool.submit(run_cli, command, env, ctx)
    return pool


def run_battery(cases=None, root=None, progress=True) -> Report:
    """Run ``cases`` (default: all) and classify each."""
    cases = CASES if cases is None else cases
    report = Report()
    start, cpu = time.perf_counter(), time.process_time()
    with contextlib.ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="battery-")))
        env = Env(Path(root))
        ctx = _context() if any(c.name.startswith("cli.") for c in cases) else None
        if ctx is not None:
            stack.callback(prefetch(cases, env, ctx).shutdown, cancel_futures=True)
        bar = _bar(len(cases), progress)
        for c in cases:
            bar.set_postfix_str(c.name)
            t = time.perf_counter()
            report.outcomes[c.name] = classify(c, env, ctx)
            report.times[c.name] = time.perf_counter() - t
            bar.update()
        bar.close()
    report.seconds = time.perf_counter() - start
    report.cpu = (time.process_time() - cpu, env.cpu)
    return report


def _bar(total, progress):
    from tqdm import tqdm

    return tqdm(total=total, disable=not progress, desc="battery", leave=False)


# Cases kept in modules of their own (tests/battery_*.py), one per area, register
# themselves with ``case`` / ``clear`` / ``graceful`` of this module when imported.
sys.modules.setdefault("battery", sys.modules[__name__])  # the same module when run as a script
for _extra in sorted(Path(__file__).parent.glob("battery_*.py")):
    __import__(_extra.stem)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument("--all", action="store_true", help="list every case, not only bad ones")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if args.k in c.name]
    report = run_battery(cases)
    for c in cases:
        o = report.outcomes[c.name]
        if args.all or o.kind != c.expect:
            print(f"--- {c.name}: {o.kind} (good: {c.expect}) {c.what}")
            print("    " + o.detail.strip().replace("\n", "\n    "))
    print()
    print(report.table())
    slow = sorted(report.times.items(), key=lambda kv: -kv[1])[:5]
    print(
        f"\n{len(cases)} cases in {report.seconds:.0f} s (CPU: {report.cpu[0]:.0f} s here, "
        f"{report.cpu[1]:.0f} s in command-line children; load average "
        f"{os.getloadavg()[0]:.1f}); slowest: " + ", ".join(f"{n} {t:.1f} s" for n, t in slow)
    )
    return 0 if all(report.outcomes[c.name].kind == c.expect for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
