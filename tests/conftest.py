"""Shared test set-up: the Triton interpreter on where there is no GPU, each test's own seed
(`seeded`, from `--test-seed` and the test's id), `--test-order` to run the tests reversed or
shuffled, and `cuda` tests skipped without a GPU."""

import os
import random
import zlib

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter; it must be on before they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--test-seed", type=int, default=0,
                     help="base of every test's random seed (each test adds a hash of its id), so "
                          "a run can be repeated with other inputs: --test-seed 1, 2, ...")
    parser.addoption("--test-order", choices=("file", "reverse", "shuffle"), default="file",
                     help="run the collected tests in file order, reversed, or shuffled (shows "
                          "tests that depend on what an earlier test left in the process)")
    parser.addoption("--test-order-seed", type=int, default=0,
                     help="seed of --test-order shuffle")


@pytest.fixture(autouse=True)
def seeded(request):
    """Every test draws its random inputs from its own seed: the same in any order, on any
    xdist worker, and another with --test-seed."""
    seed = request.config.getoption("--test-seed") + zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed


def pytest_collection_modifyitems(config, items):
    order = config.getoption("--test-order")
    if order == "reverse":
        items.reverse()
    elif order == "shuffle":
        random.Random(config.getoption("--test-order-seed")).shuffle(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
