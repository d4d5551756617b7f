"""The tests start role processes with the same classes as the local cluster."""

from kvspsite.processes import (  # noqa: F401
    BIN,
    PYTHON,
    ROOT,
    Beat,
    Process,
    Server,
    Worker,
    free_port,
    run_manage,
)
