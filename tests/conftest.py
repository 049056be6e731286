import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same torch random state."""
    torch.manual_seed(0)
