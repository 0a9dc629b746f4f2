import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``requires_gpu`` when no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="requires a CUDA GPU")
    for item in items:
        if "requires_gpu" in item.keywords:
            item.add_marker(skip)
