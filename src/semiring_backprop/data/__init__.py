"""Data for the experiments: the synthetic tasks and the agreement readers.

``TASKS`` maps each synthetic task's name to its generator (``make_task`` takes the
name); ``MASK`` is the word that marks the verb in agreement sentences (``***mask***``,
as in the Linzen/Goldberg files), replaced by the model's own mask token when a
sentence is fed to a model.

Examples:
    >>> from semiring_backprop import data
    >>> sorted(data.TASKS)
    ['AdjacentDuplicate', 'BinCountOnes', 'Contains1', 'ContainsTokenSet',
     'FirstTokenRepeatedImmediately', 'FirstTokenRepeatedLast', 'FirstTokenRepeatedOnce']
    >>> task = data.make_task("FirstTokenRepeatedOnce", 100, length=10, vocab_size=20)
    >>> task.train.x.shape
    torch.Size([70, 10])
    >>> with open("api-agreement.tsv", "w") as f:
    ...     _ = f.write("1\\tthe keys to the cabinet are here\\t"
    ...                 f"the keys to the cabinet {data.MASK} here\\tare\\tis\\n")
    >>> data.read_agreement("api-agreement.tsv")[0].masked(tok.mask_token)
    'the keys to the cabinet [MASK] here'
"""

from .agreement import MASK, AgreementData, AgreementExample, Malformed, locate
from .agreement_files import read_agreement, read_blimp, read_linzen
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
