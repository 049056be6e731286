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


def official(uid, pair, good, bad, prefix, word_good, word_bad, **more):
    """A line with every field of the official BLiMP files (one-prefix paradigms)."""
    return json.dumps({
        "sentence_good": good, "sentence_bad": bad, "one_prefix_prefix": prefix,
        "one_prefix_word_good": word_good, "one_prefix_word_bad": word_bad, **more,
        "field": "morphology", "linguistics_term": "subject_verb_agreement", "UID": uid,
        "simple_LM_method": True, "one_prefix_method": True, "two_prefix_method": False,
        "lexically_identical": False, "pairID": str(pair),
    })  # fmt: skip


def two_prefix(pair, good, bad, prefix_good, prefix_bad, word):
    """A line of the official two-prefix files (the sentences differ in the subject)."""
    return json.dumps({
        "sentence_good": good, "sentence_bad": bad, "two_prefix_prefix_good": prefix_good,
        "two_prefix_prefix_bad": prefix_bad, "two_prefix_word": word, "field": "morphology",
        "linguistics_term": "subject_verb_agreement",
        "UID": "regular_plural_subject_verb_agreement_2", "simple_LM_method": True,
        "one_prefix_method": False, "two_prefix_method": True, "lexically_identical": False,
        "pairID": str(pair),
    })  # fmt: skip


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
    data = read_agreement(path)
    a, b = data
    assert data.skipped == []
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


# Lines as the official distractor-agreement files write them: a verb phrase of two
# words ("works with"), a verb of several word pieces ("hasn't"), the verb last
# ("waves."), and (from determiner_noun_agreement_with_adjective_1) phrases whose
# second word differs.
OFFICIAL = [
    ("distractor_agreement_relative_clause", 11,
     "The girl who doesn't annoy these adults works with Kristin.",
     "The girl who doesn't annoy these adults work with Kristin.",
     "The girl who doesn't annoy these adults", "works with", "work with"),
    ("distractor_agreement_relational_noun", 0,
     "A niece of most senators hasn't descended most slopes.",
     "A niece of most senators haven't descended most slopes.",
     "A niece of most senators", "hasn't", "haven't"),
    ("distractor_agreement_relative_clause", 9, "A doctor who researched the Clintons waves.",
     "A doctor who researched the Clintons wave.", "A doctor who researched the Clintons",
     "waves", "wave"),
    ("determiner_noun_agreement_with_adjective_1", 5, "Carla cleans that art gallery.",
     "Carla cleans that art galleries.", "Carla cleans that", "art gallery", "art galleries"),
    ("distractor_agreement_relational_noun", 7, "The sketches of Dana look like Eva.",
     "The sketches of Dana looks like Eva.", "The sketches of Dana", "look like.",
     "looks like."),
]  # fmt: skip
EXPECTED = [
    (("The", "girl", "who", "doesn't", "annoy", "these", "adults", MASK, "with", "Kristin."),
     7, "works", "work"),
    (("A", "niece", "of", "most", "senators", MASK, "descended", "most", "slopes."),
     5, "hasn't", "haven't"),
    (("A", "doctor", "who", "researched", "the", "Clintons", MASK, "."), 6, "waves", "wave"),
    (("Carla", "cleans", "that", "art", MASK, "."), 4, "gallery", "galleries"),
]  # fmt: skip


def test_read_blimp_official_lines_with_phrases(tmp_path):
    lines = [official(*row, dependency_length=5) for row in OFFICIAL]
    path = write(tmp_path, "distractor.jsonl", lines)
    data = read_blimp(path)
    got = [(ex.words, ex.mask_index, ex.good, ex.bad) for ex in data]
    assert got == EXPECTED
    for ex, (_, _, good, bad, *_) in zip(data, OFFICIAL):  # "waves." -> "waves ."
        assert ex.sentence().replace(" .", ".") == good
        assert ex.sentence(good=False).replace(" .", ".") == bad
    assert [ex.source for ex in data] == [f"{path}:{n}" for n in range(1, 5)]
    # "look like." is not how the sentence goes on ("look like Eva."): that line alone
    # is reported, with its file and line, and skipped
    (bad,) = data.skipped
    assert bad.source == f"{path}:5"
    assert bad.reason.startswith("sentence_good 'The sketches of Dana look like Eva.' does not")


def test_two_prefix_lines_say_what_they_are(tmp_path):
    lines = [
        two_prefix(0, "The students perform.", "The student perform.", "The students",
                   "The student", "perform"),
        two_prefix(1, "The glove tightens.", "The gloves tightens.", "The glove", "The gloves",
                   "tightens"),
    ]  # fmt: skip
    path = write(tmp_path, "regular_2.jsonl", lines)
    with pytest.raises(InputError) as info:
        read_blimp(path)
    message = str(info.value)
    assert message.startswith(f"{path}: none of its 2 non-blank lines is a usable example")
    assert f"{path}:1: a two-prefix pair" in message and "'The students' / 'The student'" in message
    assert "give a one-prefix file" in message
    # beside a usable line, the two-prefix one is skipped and reported
    mixed = write(tmp_path, "mixed.jsonl", [blimp_row(), lines[0]])
    data = read_blimp(mixed)
    assert len(data) == 1 and [m.source for m in data.skipped] == [f"{mixed}:2"]
    assert data.skipped[0].reason.startswith("a two-prefix pair")


BLIMP_ERRORS = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, found list"),
    (json.dumps({"sentence_good": "x"}), "missing or non-string sentence_bad"),
    (blimp_row(sentence_good="The keys to a cabinet are here."), "sentence_good .* does not"),
    (blimp_row(sentence_bad="The keys to the cabinet are here."), "sentence_bad .* does not"),
    (blimp_row(sentence_good="The keys to the cabinet aren't here."), "sentence_good"),
    (blimp_row(sentence_bad="The keys to the cabinet is there."),
     "sentence_good and sentence_bad differ after the verb"),
    (blimp_row(one_prefix_word_good="are not"), "one_prefix_word_good .* must differ in exactly"),
    (blimp_row(one_prefix_word_good="are here", one_prefix_word_bad="is there"),
     "one_prefix_word_good .* must differ in exactly one word"),
    (blimp_row(one_prefix_word_good=" "), "one_prefix_word_good is empty"),
    (blimp_row(subject=9), r"subject must hold word indices in 0..6, got 9"),
    (blimp_row(attractors=3), "attractors must be a list"),
    (blimp_row(attractors=[1, "x"]), "attractors must hold word indices"),
    (blimp_row(subject=5), "subject 5 is the verb's own position"),
    (blimp_row(subject=1, attractors=[4, 4]), "attractors list word 4 more than once"),
    (blimp_row(subject=1, attractors=[5]), "attractor 5 is the verb's position"),
    (blimp_row(subject=1, attractors=[1]), "attractor 1 is the subject"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "needle"), BLIMP_ERRORS)
def test_malformed_blimp_line_is_skipped_and_named(tmp_path, line, needle):
    path = write(tmp_path, "b.jsonl", [blimp_row(), "", line, blimp_row()])
    data = read_blimp(path)
    assert [ex.source for ex in data] == [f"{path}:1", f"{path}:4"]
    (bad,) = data.skipped
    assert bad.source == f"{path}:3" and re.match(needle, bad.reason), bad.reason
    with pytest.raises(InputError, match=f"b.jsonl:3: {needle}"):
        read_blimp(path, strict=True)
    alone = write(tmp_path, "alone.jsonl", [line])  # no usable example: the file is refused
    with pytest.raises(
        InputError, match=f"none of its 1 non-blank lines .*alone.jsonl:1: {needle}"
    ):
        read_blimp(alone)


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
def test_binary_and_deeply_nested_lines_are_skipped(tmp_path, data, needle):
    path = tmp_path / "b.jsonl"
    path.write_bytes(blimp_row().encode() + b"\n" + data)
    out = read_blimp(path)
    assert len(out) == 1 and len(out.skipped) == 1
    assert re.match(needle, f"{out.skipped[0].source.rsplit('/', 1)[-1]}: {out.skipped[0].reason}")
    with pytest.raises(InputError, match=needle):
        read_blimp(path, strict=True)
    path.write_bytes(data * 3)  # nothing but such lines: refused, the first three named
    with pytest.raises(InputError, match=f"none of its 3 non-blank lines .*{needle}"):
        read_blimp(path)


def test_many_malformed_lines_are_all_counted(tmp_path):
    lines = ["{not json"] * 5
    with pytest.raises(InputError, match=r"none of its 5 .*b.jsonl:3: .*\(and 2 more\)$"):
        read_blimp(write(tmp_path, "b.jsonl", lines))
    data = read_blimp(write(tmp_path, "c.jsonl", [*lines, blimp_row()]))
    assert len(data) == 1
    assert [m.source.rsplit(":", 1)[1] for m in data.skipped] == ["1", "2", "3", "4", "5"]


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
def test_malformed_linzen_line_is_skipped_and_named(tmp_path, line, needle):
    path = write(tmp_path, "l.tsv", [linzen_line(), line])
    data = read_linzen(path)
    assert len(data) == 1 and data[0].source == f"{path}:1"
    (bad,) = data.skipped
    assert bad.source == f"{path}:2" and re.search(needle, bad.reason), bad.reason
    with pytest.raises(InputError, match=f"l.tsv:2: .*{needle}"):
        read_linzen(path, strict=True)
    with pytest.raises(InputError, match=f"none of its 1 .*alone.tsv:1: .*{needle}"):
        read_linzen(write(tmp_path, "alone.tsv", [line]))


def test_read_agreement_errors(tmp_path):
    with pytest.raises(InputError, match="nope.tsv' does not exist"):
        read_agreement(tmp_path / "nope.tsv")
    with pytest.raises(InputError, match="nope.jsonl' does not exist"):
        read_blimp(tmp_path / "nope.jsonl")
    path = write(tmp_path, "data.csv", [linzen_line()])
    with pytest.raises(InputError, match="extension '.csv'.*read_blimp/read_linzen"):
        read_agreement(path)
    empty = write(tmp_path, "empty.jsonl", ["", "  "])
    assert read_blimp(empty) == [] and read_blimp(empty).skipped == []


# ---------------------------------------------------------------------------------------
# locate: the parser's tokens mapped back to words. Parses are set by hand, through a
# duck-typed stub (no spaCy needed) and through spaCy's own Doc (where spaCy is
# installed); both give the same answers.


class Tok:
    def __init__(self, i, text, idx, tag, dep):
        self.i, self.text, self.idx, self.tag_, self.dep_ = i, text, idx, tag, dep
        self.head = self


def _offsets(text, pieces):
    at, out = 0, []
    for piece in pieces:
        at = text.index(piece, at)
        out.append(at)
        at += len(piece)
    return out


def stub_nlp(spec):
    """An ``nlp`` returning tokens ``(text, tag, dep, head index)`` laid over the text."""

    def nlp(text):
        starts = _offsets(text, [piece for piece, *_ in spec])
        toks = [
            Tok(i, p, at, tag, dep) for i, ((p, tag, dep, _), at) in enumerate(zip(spec, starts))
        ]
        for tok, (*_, head) in zip(toks, spec):
            tok.head = toks[head]
        nlp.seen.append(text)
        return toks

    nlp.seen = []
    return nlp


_POS = {"DT": "DET", "IN": "ADP", "JJ": "ADJ", "RB": "ADV", "POS": "PART", "PRP": "PRON",
        "NNP": "PROPN", "VBZ": "VERB", "VBP": "VERB", "VBG": "VERB", "MD": "AUX"}  # fmt: skip


def spacy_nlp(spec):
    """The same parse as a spaCy ``Doc`` with hand-set heads, deps, tags and POS."""
    pytest.importorskip("spacy")
    from spacy.tokens import Doc
    from spacy.vocab import Vocab

    vocab = Vocab()

    def nlp(text):
        pieces = [piece for piece, *_ in spec]
        ends = [at + len(p) for at, p in zip(_offsets(text, pieces), pieces)]
        tags = [t for _, t, _, _ in spec]
        pos = [_POS.get(t, "NOUN" if t.startswith("NN") else "X") for t in tags]
        return Doc(vocab, words=pieces, spaces=[text[e : e + 1] == " " for e in ends],
                   heads=[h for *_, h in spec], deps=[d for _, _, d, _ in spec], tags=tags,
                   pos=pos)  # fmt: skip

    nlp.seen = []
    return nlp


@pytest.fixture(params=["stub", "spacy"])
def parser(request):
    return stub_nlp if request.param == "stub" else spacy_nlp


# "The boss's keys near the old cabinet are here": "boss's" splits in two tokens,
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
    ("are", "VBP", "ROOT", 8),
    ("here", "RB", "advmod", 8),
]


def linzen_example(tmp_path, sentence, good, bad):
    words = sentence.split()
    i = words.index(good)
    masked = " ".join(MASK if j == i else w for j, w in enumerate(words))
    path = write(tmp_path, "x.tsv", [linzen_line("1", sentence, masked, good, bad)])
    return read_linzen(path)[0]


def test_locate_maps_tokens_to_words(tmp_path, parser):
    ex = linzen_example(tmp_path, "The boss's keys near the old cabinet are here", "are", "is")
    nlp = stub_nlp(SENTENCE)
    (out,) = locate([ex], nlp=nlp)
    assert nlp.seen == ["The boss's keys near the old cabinet are here"]
    (out,) = locate([ex], nlp=parser(SENTENCE))
    assert out.subject == 2  # word "keys", token 3
    assert out.attractor_positions == (6,)  # word "cabinet", token 7
    assert out.attractors == 1 and out.words == ex.words and out.source == ex.source
    assert out.unlocated is None
    assert locate([ex], nlp=parser(SENTENCE), progress=True) == [out]  # with a tqdm bar


def test_locate_auxiliary_and_copula(tmp_path, parser):
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
    (out,) = locate([ex], nlp=parser(aux))
    assert (out.subject, out.attractor_positions) == (1, (4,))
    # a UD-style parse: the copula hangs off the predicate, which holds the subject
    ex = linzen_example(tmp_path, "The dogs near the cat are happy", "are", "is")
    cop = [(w, "JJ" if w == "barking" else t, "cop" if d == "aux" else d, h)
           for w, t, d, h in aux]  # fmt: skip
    cop[-1] = ("happy", "JJ", "ROOT", 6)
    (out,) = locate([ex], nlp=parser(cop))
    assert (out.subject, out.attractor_positions) == (1, (4,))
    # a contraction is two tokens of one word; its first, "has", is the auxiliary
    ex = linzen_example(tmp_path, "A niece of most senators hasn't descended", "hasn't", "haven't")
    contraction = [
        ("A", "DT", "det", 1),
        ("niece", "NN", "nsubj", 7),
        ("of", "IN", "prep", 1),
        ("most", "JJS", "amod", 4),
        ("senators", "NNS", "pobj", 2),
        ("has", "VBZ", "aux", 7),
        ("n't", "RB", "neg", 7),
        ("descended", "VBN", "ROOT", 7),
    ]
    (out,) = locate([ex], nlp=parser(contraction))
    assert (out.subject, out.attractor_positions, out.unlocated) == (1, (4,), None)
    # a parse with no token at the verb's word (a stub: a Doc covers its whole text)
    no_verb = [*contraction[:5], ("descended", "VBN", "ROOT", 5)]
    no_verb[1] = ("niece", "NN", "nsubj", 5)
    (out,) = locate([ex], nlp=stub_nlp(no_verb))
    assert out.subject is None and out.unlocated == "no subject: the parse has no token at the verb"


# The failure the nearest-noun fallback had: the parser tags the verb "hurts" as a plural
# noun, so the verb has no subject; the nearest noun before it is "trucks", the
# attractor (by construction of agreement data). No answer is better than that one.
HURTS = [
    ("The", "DT", "det", 1),
    ("sketch", "NN", "ROOT", 1),
    ("of", "IN", "prep", 1),
    ("those", "DT", "det", 5),
    ("trucks", "NNS", "compound", 5),
    ("hurts", "NNS", "pobj", 2),
    ("Alan", "NNP", "appos", 5),
]


def test_locate_gives_no_answer_rather_than_the_attractor(tmp_path, parser):
    ex = linzen_example(tmp_path, "The sketch of those trucks hurts Alan", "hurts", "hurt")
    (out,) = locate([ex], nlp=parser(HURTS))
    assert out.subject is None and out.attractor_positions is None
    assert out.unlocated == "no subject: the parse gives the verb (tagged NNS, dep pobj) no nsubj"
    # the parser took the attractor for the subject: it disagrees with the verb's number
    wrong = [("The", "DT", "det", 1), ("sketch", "NN", "nmod", 5), ("of", "IN", "prep", 1),
             ("those", "DT", "det", 4), ("trucks", "NNS", "nsubj", 5),
             ("hurts", "VBZ", "ROOT", 5), ("Alan", "NNP", "dobj", 5)]  # fmt: skip
    (out,) = locate([ex], nlp=parser(wrong))
    assert out.subject is None and out.attractor_positions is None
    assert out.unlocated == (
        "no subject: the parse's subject (NNS, plural) does not agree with the verb (singular)"
    )
    # two subjects of one verb: ambiguous, no answer
    two = [*wrong[:4], wrong[4], wrong[5], ("Alan", "NNP", "nsubj", 5)]
    two[1] = ("sketch", "NN", "nsubj", 5)
    (out,) = locate([ex], nlp=parser(two))
    assert out.subject is None and "several subjects" in out.unlocated
    # and the right parse: the subject is "sketch"; "trucks" is its attractor
    right = [*wrong]
    right[1], right[4] = ("sketch", "NN", "nsubj", 5), ("trucks", "NNS", "pobj", 2)
    (out,) = locate([ex], nlp=parser(right))
    assert (out.subject, out.attractor_positions, out.unlocated) == (1, (4,), None)


def test_locate_keeps_what_the_data_gives(tmp_path, parser):
    ex = linzen_example(tmp_path, "The boss's keys near the old cabinet are here", "are", "is")
    ex = replace(ex, subject=1)  # a (wrong) subject from the data: "boss's"
    (out,) = locate([ex], nlp=parser(SENTENCE))
    assert out.subject == 1
    assert out.attractor_positions == (2,)  # "keys" differs from the singular "boss"


def test_locate_needs_spacy_and_its_pipeline(tmp_path, monkeypatch):
    ex = linzen_example(tmp_path, "dogs bark", "bark", "barks")
    monkeypatch.setitem(sys.modules, "spacy", None)  # import spacy -> ImportError
    with pytest.raises(InputError, match="needs spaCy, which is not installed: pip install spacy"):
        locate([ex])
    fake = types.ModuleType("spacy")
    asked = []

    def load(name):
        asked.append(name)
        raise OSError(f"[E050] Can't find model '{name}'")

    fake.load = load
    monkeypatch.setitem(sys.modules, "spacy", fake)
    with pytest.raises(InputError, match="pipeline 'en_core_web_sm' is not .*spacy download"):
        locate([ex])
    with pytest.raises(InputError, match="pipeline 'en_core_web_trf' is not"):
        locate([ex], nlp="en_core_web_trf")  # the pipeline is an option
    assert asked == ["en_core_web_sm", "en_core_web_trf"]
    with pytest.raises(InputError, match="nlp='': name a spaCy pipeline"):
        locate([ex], nlp="")  # not the default in disguise


def test_locate_loads_a_pipeline_by_directory_and_needs_its_parser(tmp_path):
    spacy = pytest.importorskip("spacy")
    spacy.blank("en").to_disk(tmp_path / "blank")  # a real pipeline, without a parser
    ex = linzen_example(tmp_path, "dogs bark", "bark", "barks")
    with pytest.raises(InputError, match="x.tsv:1: the parser gave no dependency labels"):
        locate([ex], nlp=str(tmp_path / "blank"))


def test_a_byte_order_mark_is_no_data(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + blimp_row().encode() + b"\n")
    data = read_blimp(path)
    assert len(data) == 1 and data.skipped == [] and data[0].words[0] == "The"
    path = tmp_path / "bom.tsv"
    path.write_bytes(b"\xef\xbb\xbf" + linzen_line().encode() + b"\n")
    assert read_linzen(path)[0].attractors == 1
