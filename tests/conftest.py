import os

import pytest
import torch
from hypothesis import settings

# CI draws the same examples every run (a red build must be reproducible); locally they vary,
# so property tests keep exploring.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

from encoder import EncoderArgs, load_encoder, write_random_checkpoint


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")
    config.addinivalue_line("markers", "slow: takes tens of seconds on 2 CPU cores")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_args():
    return EncoderArgs.tiny()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_args):
    """A random checkpoint in the released layout at tiny dims, fp32 so comparisons are exact."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), tiny_args, seed=0,
                                   dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_encoder(tiny_checkpoint):
    return load_encoder(tiny_checkpoint)
