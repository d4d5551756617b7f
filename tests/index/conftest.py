"""Scopes and a holder principal that the Index Service tests share."""

import pytest

from tests.support.fixtures import HOLDER_A, make_caller, make_scope


@pytest.fixture
def scope():
    return make_scope("tenant-a")


@pytest.fixture
def other_scope():
    return make_scope("tenant-b")


@pytest.fixture
def holder_a(scope):
    return make_caller("holder-a", scopes=[scope], holders=[HOLDER_A])
