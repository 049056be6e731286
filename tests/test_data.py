"""semiring_backprop.data: synthetic tasks checked by brute-force labellers, and the
agreement readers on small files."""

from __future__ import annotations

import json
import re
import sys
import time
import types
from collections import Counter
from dataclasses import replace

import pytest
import torch

from semiring_backprop.data import (
    MASK,
    TASKS,
    first_feature,
    locate,
    make_task,
    read_agreement,
    read_blimp,
    read_linzen,
)
from semiring_backprop.errors import InputError

# ---------------------------------------------------------------------------------------
# Brute-force labellers: plain loops over one sequence. None = belongs to no class
# (the generator must never produce it).


def first_token_repeated_once(seq, **_):
    repeats = seq[1:].count(seq[0])
    return {0: 0, 1: 1}.get(repeats)


def first_token_repeated_immediately(seq, **_):
    return int(seq[1] == seq[0])


def first_token_repeated_last(seq, **_):
    return int(seq[-1] == seq[0])


def adjacent_duplicate(seq, **_):
    return int(any(seq[i] == seq[i + 1] for i in range(len(seq) - 1)))


def contains_1(seq, **_):
    return int(1 in seq)


def contains_token_set(seq, tokens=(1, 2, 3), **_):
    return int(all(t in seq for t in tokens))


def bin_count_ones(seq, k=2, **_):
    ones = seq.count(1)
    width = len(seq) // k
    for c in range(k):
        if c * width + 1 <= ones <= (c + 1) * width:
            return c
    return None


ORACLES = {
    "FirstTokenRepeatedOnce": first_token_repeated_once,
    "FirstTokenRepeatedImmediately": first_token_repeated_immediately,
    "FirstTokenRepeatedLast": first_token_repeated_last,
    "AdjacentDuplicate": adjacent_duplicate,
    "Contains1": contains_1,
    "ContainsTokenSet": contains_token_set,
    "BinCountOnes": bin_count_ones,
}

# (task, length, vocab_size, params): the defaults, the smallest vocabulary and others
CASES = [
    *[(name, 10, 20, {}) for name in ORACLES],
    *[(name, 6, 3, {}) for name in ORACLES if name not in ("ContainsTokenSet", "BinCountOnes")],
    ("FirstTokenRepeatedImmediately", 2, 5, {}),
    ("FirstTokenRepeatedLast", 2, 5, {}),
    ("AdjacentDuplicate", 2, 4, {}),
    ("Contains1", 1, 4, {}),
    ("ContainsTokenSet", 6, 3, {"tokens": (1, 2)}),
    ("ContainsTokenSet", 12, 30, {"tokens": {29, 7}}),
    ("ContainsTokenSet", 5, 10, {"tokens": [1, 2, 3, 4, 5]}),
    ("BinCountOnes", 12, 20, {"k": 4}),
    ("BinCountOnes", 6, 3, {"k": 3}),
    ("BinCountOnes", 8, 10, {"k": 8}),
]


def everything(data):
    x = torch.cat([data.train.x, data.val.x, data.test.x])
    y = torch.cat([data.train.y, data.val.y, data.test.y])
    return x, y


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("name", "length", "vocab", "params"), CASES)
def test_labels_match_brute_force(name, length, vocab, params, seed):
    data = make_task(name, 240, length=length, vocab_size=vocab, seed=seed, **params)
    x, y = everything(data)
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.shape == (240, length)
    classes = params.get("k", 2)
    assert data.num_classes == classes and data.vocab_size == vocab and data.length == length
    low = 2 if name == "BinCountOnes" else 1
    for seq, label in zip(x.tolist(), y.tolist()):
        assert ORACLES[name](seq, **params) == label, seq
        # token 0 (padding) never occurs; BinCountOnes fills with 2..V-1 around its ones
        assert all(low <= t < vocab for t in seq if not (name == "BinCountOnes" and t == 1))
    assert Counter(y.tolist()) == {c: 240 // classes for c in range(classes)}
    assert y.tolist() != sorted(y.tolist()) and y.tolist() != sorted(y.tolist(), reverse=True)


@pytest.mark.parametrize("name", list(TASKS))
def test_reproducible_and_seed_dependent(name):
    a, b, c = (make_task(name, 100, seed=s) for s in (3, 3, 4))
    for split in ("train", "val", "test"):
        sa, sb = getattr(a, split), getattr(b, split)
        assert torch.equal(sa.x, sb.x) and torch.equal(sa.y, sb.y)
    assert not torch.equal(a.train.x, c.train.x)
    assert a.seed == 3 and c.seed == 4


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1000, (700, 100, 200)), (4320, (3024, 432, 864)), (10, (7, 1, 2)), (2, (2, 0, 0))],
)
def test_split_sizes_70_10_20(n, expected):
    data = make_task("Contains1", n)
    assert (len(data.train), len(data.val), len(data.test)) == expected


def test_exact_sizes_and_default_n():
    data = make_task("BinCountOnes", sizes=(30, 6, 0), length=12, k=3)
    assert (len(data.train), len(data.val), len(data.test)) == (30, 6, 0)
    assert data.test.x.shape == (0, 12)
    assert len(everything(make_task("AdjacentDuplicate"))[1]) == 1000
    assert make_task("Contains1", 36, sizes=(30, 6, 0)).train.x.shape == (30, 10)


def test_names():
    assert make_task("BinCountOnes", 8, length=12, k=4).name == "BinCountOnes(k=4)"
    assert make_task("BinCountOnes", 8).name == "BinCountOnes(k=2)"
    assert make_task("Contains1", 8).name == "Contains1"
    assert make_task("ContainsTokenSet", 8, tokens={3, 1}).name == "ContainsTokenSet(tokens={1, 3})"


def test_first_token_repeat_covers_every_later_position():
    x, y = everything(make_task("FirstTokenRepeatedOnce", 4000, length=10, vocab_size=20))
    where = Counter()
    firsts = Counter()
    for seq, label in zip(x.tolist(), y.tolist()):
        firsts[seq[0]] += 1
        if label:
            where[next(j for j in range(1, 10) if seq[j] == seq[0])] += 1
    assert set(where) == set(range(1, 10))
    assert min(where.values()) > 2000 / 9 / 2  # ~222 each if uniform
    assert set(firsts) == set(range(1, 20))


def test_other_positions_are_spread():
    x, y = everything(make_task("AdjacentDuplicate", 2000, length=8))
    pairs = Counter(
        i
        for seq, lab in zip(x.tolist(), y.tolist())
        if lab
        for i in range(7)
        if seq[i] == seq[i + 1]
    )
    assert set(pairs) == set(range(7))
    x, y = everything(make_task("Contains1", 2000, length=8))
    ones = Counter(
        i for seq, lab in zip(x.tolist(), y.tolist()) if lab for i in range(8) if seq[i] == 1
    )
    assert set(ones) == set(range(8))


def test_bin_count_ones_uses_every_count():
    x, y = everything(make_task("BinCountOnes", 2100, length=12, k=3))
    counts = {c: set() for c in range(3)}
    positions = Counter()
    for seq, label in zip(x.tolist(), y.tolist()):
        counts[label].add(seq.count(1))
        positions.update(i for i, t in enumerate(seq) if t == 1)
    assert counts == {0: {1, 2, 3, 4}, 1: {5, 6, 7, 8}, 2: {9, 10, 11, 12}}
    assert set(positions) == set(range(12))
    assert max(positions.values()) < 1.3 * min(positions.values())


def test_first_feature():
    data = first_feature(2000, seed=5)
    x, y = everything(data)
    assert x.dtype == torch.float32 and x.shape == (2000, 4) and y.dtype == torch.int64
    assert ((x >= 0) & (x <= 1)).all()
    for row, label in zip(x.tolist(), y.tolist()):
        assert label == int(row[0] > 0.5)
    assert Counter(y.tolist()) == {0: 1000, 1: 1000}
    assert (len(data.train), len(data.val), len(data.test)) == (1400, 200, 400)
    assert data.num_classes == 2 and data.vocab_size is None and data.length is None
    assert torch.equal(first_feature(10, seed=1).train.x, first_feature(10, seed=1).train.x)
    assert first_feature(sizes=(4, 2, 2), features=3).train.x.shape == (4, 3)
    assert x[:, 1:].std(0).min() > 0.25  # the other features are noise, uniform on [0, 1]


def test_loader():
    split = make_task("Contains1", 100).train
    batches = list(split.loader(32))
    assert [len(b[1]) for b in batches] == [32, 32, 6]
    assert torch.equal(torch.cat([b[0] for b in batches]), split.x)
    order = [torch.cat([b[1] for b in split.loader(16, shuffle=True, seed=s)]) for s in (1, 1)]
    assert torch.equal(order[0], order[1])
    xs = torch.cat([b[0] for b in split.loader(16, shuffle=True, seed=1)])
    assert not torch.equal(xs, split.x)
    assert sorted(map(tuple, xs.tolist())) == sorted(map(tuple, split.x.tolist()))
    with pytest.raises(InputError, match="batch_size must be a positive integer"):
        split.loader(0)


def test_fast():
    for name in TASKS:
        start = time.perf_counter()
        make_task(name, 10_000)
        params = {"k": 4} if name == "BinCountOnes" else {}
        make_task(name, sizes=(3600, 360, 360), length=36, vocab_size=60, **params)
        assert time.perf_counter() - start < 1.0, name


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: make_task("Contains2"), "unknown task 'Contains2'; known tasks: .*BinCountOnes"),
        (lambda: make_task("BinCountOnes", length=10, k=4), "k=4 must divide the length L=10"),
        (lambda: make_task("BinCountOnes", k=1), "k .* must be an integer >= 2"),
        (lambda: make_task("BinCountOnes", vocab_size=2), "vocab_size must be an integer >= 3"),
        (lambda: make_task("FirstTokenRepeatedOnce", vocab_size=2), "vocab_size must be .* >= 3"),
        (lambda: make_task("AdjacentDuplicate", length=1), "length must be an integer >= 2"),
        (lambda: make_task("Contains1", 11), "n=11 .* 2 equal classes; use a multiple of 2"),
        (lambda: make_task("BinCountOnes", 12, k=5), "n=12 .* 5 equal classes"),
        (lambda: make_task("BinCountOnes", 2, k=5), r"use a multiple of 5 \(e.g. 5\)"),
        (lambda: make_task("Contains1", 0), "n must be a positive integer"),
        (lambda: make_task("Contains1", sizes=(7, 1)), "sizes must be 3 non-negative integers"),
        (lambda: make_task("Contains1", sizes=(7, -1, 2)), "sizes must be 3 non-negative"),
        (lambda: make_task("Contains1", sizes=(7.0, 1, 2)), "sizes must be 3 non-negative"),
        (lambda: make_task("Contains1", 100, sizes=(70, 10, 10)), "add up to 90"),
        (lambda: make_task("ContainsTokenSet", tokens=(0, 1)), r"tokens \[0\] are outside 1..19"),
        (lambda: make_task("ContainsTokenSet", tokens=(1, 20)), r"tokens \[20\] are outside"),
        (lambda: make_task("ContainsTokenSet", tokens=()), "non-empty"),
        (lambda: make_task("ContainsTokenSet", tokens=(1, 1)), "must not repeat"),
        (lambda: make_task("ContainsTokenSet", length=2), "3 tokens do not fit in length 2"),
        (lambda: make_task("ContainsTokenSet", vocab_size=2, tokens=(1,)), "too rare"),
        (lambda: make_task("Contains1", k=3), "Contains1 does not take k; it takes: no param"),
        (lambda: make_task("BinCountOnes", tokens=(1,)), "does not take tokens; it takes: k"),
        (lambda: make_task("Contains1", seed=-1), "seed must be a non-negative integer"),
        (lambda: first_feature(features=0), "features must be a positive integer"),
        (lambda: first_feature(7), "n=7"),
    ],
)
def test_bad_input(call, needle):
    with pytest.raises(InputError, match=needle):
        call()


# ---------------------------------------------------------------------------------------
# Agreement readers


def blimp_row(**change):
    row = {
        "sentence_good": "The keys to the cabinet are here.",
        "sentence_bad": "The keys to the cabinet is here.",
        "one_prefix_prefix": "The keys to the cabinet",
        "one_prefix_word_good": "are",
        "one_prefix_word_bad": "is",
    }
    return json.dumps({**row, **change})


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_blimp(tmp_path):
    last = {
        "sentence_good": "The dog near the cats barks.",
        "sentence_bad": "The dog near the cats bark.",
        "one_prefix_prefix": "The dog near the cats",
        "one_prefix_word_good": "barks",
        "one_prefix_word_bad": "bark",
        "subject": 1,
        "attractors": [4],
    }
    path = write(tmp_path, "b.jsonl", [blimp_row(), "", json.dumps(last)])
    a, b = read_agreement(path)
    assert a.words == ("The", "keys", "to", "the", "cabinet", MASK, "here.")
    assert (a.mask_index, a.good, a.bad) == (5, "are", "is")
    assert a.attractors is None and a.subject is None and a.attractor_positions is None
    assert a.source == f"{path}:1"
    assert a.masked("[MASK]") == "The keys to the cabinet [MASK] here."
    assert a.sentence() == "The keys to the cabinet are here."
    assert a.sentence(good=False) == "The keys to the cabinet is here."
    # punctuation stuck to the verb becomes its own word
    assert b.words == ("The", "dog", "near", "the", "cats", MASK, ".")
    assert (b.subject, b.attractor_positions, b.attractors) == (1, (4,), 1)
    assert b.source == f"{path}:3"
    assert locate([b])[0] is b  # complete examples need no parser


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, found list"),
        (json.dumps({"sentence_good": "x"}), "missing or non-string sentence_bad"),
        (blimp_row(sentence_good="The keys to a cabinet are here."), "sentence_good .* does not"),
        (blimp_row(sentence_bad="The keys to the cabinet are here."), "sentence_bad .* does not"),
        (blimp_row(sentence_good="The keys to the cabinet aren't here."), "sentence_good"),
        (blimp_row(one_prefix_word_good="are not"), "one_prefix_word_good must be one word"),
        (blimp_row(subject=9), r"subject must hold word indices in 0..6, got 9"),
        (blimp_row(attractors=3), "attractors must be a list"),
        (blimp_row(attractors=[1, "x"]), "attractors must hold word indices"),
        (blimp_row(subject=5), "subject 5 is the verb's own position"),
        (blimp_row(subject=1, attractors=[4, 4]), "attractors list word 4 more than once"),
        (blimp_row(subject=1, attractors=[5]), "attractor 5 is the verb's position"),
        (blimp_row(subject=1, attractors=[1]), "attractor 1 is the subject"),
    ],
)
def test_read_blimp_errors_name_file_and_line(tmp_path, line, needle):
    path = write(tmp_path, "b.jsonl", [blimp_row(), "", line])
    with pytest.raises(InputError, match=f"b.jsonl:3: {needle}"):
        read_blimp(path)


def linzen_line(*cols):
    cols = cols or (
        "1",
        "the keys to the cabinet are here",
        f"the keys to the cabinet {MASK} here",
        "are",
        "is",
    )
    return "\t".join(cols)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"\xff\xfe{not utf-8}\n", "b.jsonl:2: not UTF-8 text \\(byte 0xff at column 1\\)"),
        (b"\x00\x01\x02binary\n", "b.jsonl:2: holds a NUL byte"),
        (b"[" * 100_000 + b"\n", "b.jsonl:2: JSON nested too deeply"),
    ],
)
def test_read_blimp_refuses_binary_and_deeply_nested_lines(tmp_path, data, needle):
    path = tmp_path / "b.jsonl"
    path.write_bytes(blimp_row().encode() + b"\n" + data)
    with pytest.raises(InputError, match=needle):
        read_blimp(path)


def test_read_linzen(tmp_path):
    path = write(
        tmp_path,
        "l.tsv",
        [linzen_line(), "", linzen_line("0", "dogs bark", f"dogs {MASK}", "bark", "barks")],
    )
    a, b = read_agreement(path)
    assert a.words == ("the", "keys", "to", "the", "cabinet", MASK, "here")
    assert (a.mask_index, a.good, a.bad, a.attractors) == (5, "are", "is", 1)
    assert a.subject is None and a.attractor_positions is None
    assert a.source == f"{path}:1" and b.source == f"{path}:3"
    assert b.masked("<mask>") == "dogs <mask>" and b.attractors == 0
    assert read_linzen(path) == [a, b]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("1\tonly\tthree", "expected 5 tab-separated columns .*, found 3"),
        (linzen_line() + "\textra", "found 6"),
        (linzen_line("one", "a b", f"a {MASK}", "b", "c"), r"column 1 \(number of attractors\)"),
        (linzen_line("-1", "a b", f"a {MASK}", "b", "c"), "non-negative integer"),
        (
            linzen_line("1", "a b", "a b", "b", "c"),
            f"column 3 must contain {re.escape(MASK)} exactly once",
        ),
        (linzen_line("1", "a b b", f"a {MASK} {MASK}", "b", "c"), "exactly once"),
        (linzen_line("1", "a b", f"a {MASK}.", "b", "c"), "as a word of its own"),
        (linzen_line("1", "a b c", f"x {MASK} c", "b", "c"), "columns 2 and 3 differ"),
        (linzen_line("1", "a b c", f"a {MASK}", "b", "c"), "columns 2 and 3 differ"),
        (linzen_line("1", "a b", f"a {MASK}", "", "c"), r"column 4 \(correct verb\) must be one"),
    ],
)
def test_read_linzen_errors_name_file_and_line(tmp_path, line, needle):
    path = write(tmp_path, "l.tsv", [linzen_line(), line])
    with pytest.raises(InputError, match=f"l.tsv:2: .*{needle}"):
        read_linzen(path)


def test_read_agreement_errors(tmp_path):
    with pytest.raises(InputError, match="nope.tsv' does not exist"):
        read_agreement(tmp_path / "nope.tsv")
    with pytest.raises(InputError, match="nope.jsonl' does not exist"):
        read_blimp(tmp_path / "nope.jsonl")
    path = write(tmp_path, "data.csv", [linzen_line()])
    with pytest.raises(InputError, match="extension '.csv'.*read_blimp/read_linzen"):
        read_agreement(path)


# ---------------------------------------------------------------------------------------
# locate: the parser's tokens mapped back to words, with a stub in place of spaCy


class Tok:
    def __init__(self, i, text, idx, tag, dep):
        self.i, self.text, self.idx, self.tag_, self.dep_ = i, text, idx, tag, dep
        self.head = self


def stub_nlp(spec):
    """An ``nlp`` returning tokens ``(text, tag, dep, head index)`` laid over the text."""

    def nlp(text):
        toks, pos = [], 0
        for i, (piece, tag, dep, _) in enumerate(spec):
            pos = text.index(piece, pos)
            toks.append(Tok(i, piece, pos, tag, dep))
            pos += len(piece)
        for tok, (*_, head) in zip(toks, spec):
            tok.head = toks[head]
        nlp.seen.append(text)
        return toks

    nlp.seen = []
    return nlp


# "The boss's keys near the old cabinets are here": "boss's" splits in two tokens,
# so token indices and word indices part ways after it.
SENTENCE = [
    ("The", "DT", "det", 3),
    ("boss", "NN", "poss", 3),
    ("'s", "POS", "case", 1),
    ("keys", "NNS", "nsubj", 8),
    ("near", "IN", "prep", 3),
    ("the", "DT", "det", 7),
    ("old", "JJ", "amod", 7),
    ("cabinet", "NN", "pobj", 4),
    ("is", "VBZ", "ROOT", 8),
    ("here", "RB", "advmod", 8),
]


def linzen_example(tmp_path, sentence, good, bad):
    words = sentence.split()
    i = words.index(good)
    masked = " ".join(MASK if j == i else w for j, w in enumerate(words))
    path = write(tmp_path, "x.tsv", [linzen_line("1", sentence, masked, good, bad)])
    return read_linzen(path)[0]


def test_locate_with_stub_parser(tmp_path):
    ex = linzen_example(tmp_path, "The boss's keys near the old cabinet is here", "is", "are")
    # the stub's tags say "keys" is plural, so "cabinet" (singular) is an attractor
    nlp = stub_nlp(SENTENCE)
    (out,) = locate([ex], nlp=nlp)
    assert nlp.seen == ["The boss's keys near the old cabinet is here"]
    assert out.subject == 2  # word "keys", token 3
    assert out.attractor_positions == (6,)  # word "cabinet", token 7
    assert out.attractors == 1 and out.words == ex.words and out.source == ex.source


def test_locate_auxiliary_and_fallback(tmp_path):
    ex = linzen_example(tmp_path, "The dogs near the cat are barking", "are", "is")
    aux = [
        ("The", "DT", "det", 1),
        ("dogs", "NNS", "nsubj", 6),
        ("near", "IN", "prep", 1),
        ("the", "DT", "det", 4),
        ("cat", "NN", "pobj", 2),
        ("are", "VBP", "aux", 6),
        ("barking", "VBG", "ROOT", 6),
    ]
    (out,) = locate([ex], nlp=stub_nlp(aux))
    assert (out.subject, out.attractor_positions) == (1, (4,))
    # no nsubj: the nearest noun before the verb agreeing with plural "are" is "dogs"
    flat = [(w, t, "dep", 6) for w, t, *_ in aux]
    (out,) = locate([ex], nlp=stub_nlp(flat))
    assert (out.subject, out.attractor_positions) == (1, (4,))
    # no noun before the verb at all: nothing to report
    none = [(w, "PRP" if t.startswith("NN") else t, d, h) for w, t, d, h in flat]
    (out,) = locate([ex], nlp=stub_nlp(none))
    assert out.subject is None and out.attractor_positions is None


def test_locate_keeps_what_the_data_gives(tmp_path):
    ex = linzen_example(tmp_path, "The boss's keys near the old cabinet is here", "is", "are")
    ex = replace(ex, subject=1)  # a (wrong) subject from the data: "boss's"
    (out,) = locate([ex], nlp=stub_nlp(SENTENCE))
    assert out.subject == 1
    assert out.attractor_positions == (2,)  # "keys" differs from the singular "boss"


def test_locate_without_spacy(tmp_path, monkeypatch):
    ex = linzen_example(tmp_path, "dogs bark", "bark", "barks")
    monkeypatch.setitem(sys.modules, "spacy", None)  # import spacy -> ImportError
    with pytest.raises(InputError, match="needs spaCy, which is not installed: pip install spacy"):
        locate([ex])
    fake = types.ModuleType("spacy")

    def load(name):
        raise OSError(f"[E050] Can't find model '{name}'")

    fake.load = load
    monkeypatch.setitem(sys.modules, "spacy", fake)
    with pytest.raises(InputError, match="en_core_web_sm is not: python -m spacy download"):
        locate([ex])
