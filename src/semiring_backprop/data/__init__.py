"""Data for the experiments: the synthetic tasks and the agreement readers.

>>> from semiring_backprop.data import make_task, read_agreement
>>> data = make_task("FirstTokenRepeatedOnce", 1000, length=10, vocab_size=20, seed=0)
>>> examples = read_agreement("lgd_dataset.tsv")
"""

from .agreement import (
    MASK,
    AgreementData,
    AgreementExample,
    Malformed,
    locate,
    read_agreement,
    read_blimp,
    read_linzen,
)
from .synthetic import TASKS, Split, TaskData, first_feature, make_task

__all__ = [
    "MASK",
    "TASKS",
    "AgreementData",
    "AgreementExample",
    "Malformed",
    "Split",
    "TaskData",
    "first_feature",
    "locate",
    "make_task",
    "read_agreement",
    "read_blimp",
    "read_linzen",
]
