from tests.placement.conftest import cluster  # noqa: F401 - the same constructed cluster
