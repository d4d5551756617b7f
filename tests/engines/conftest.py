"""The reference model and two reference engines on it (CPU), made once per test module: two
engines, so that a cache exported by one can be imported into the other."""

import pytest

from workers.engines.modeldir import create_reference_model
from workers.engines.reference import ReferenceEngine

B = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_reference_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def engine_a(model_dir):
    return ReferenceEngine(model_dir, block_tokens=B, device="cpu")


@pytest.fixture(scope="module")
def engine_b(model_dir):
    return ReferenceEngine(model_dir, block_tokens=B, device="cpu")
