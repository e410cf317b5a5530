import os

import pytest
import torch

from service.config import LOCAL_RAY_ENVIRONMENT

# Before anything imports Ray: the tests' own Ray listens on 127.0.0.1 only (service/config.py).
os.environ.update(LOCAL_RAY_ENVIRONMENT)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
