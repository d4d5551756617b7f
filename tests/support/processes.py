"""The tests start role processes with the same classes as the local cluster."""

import os
import socket

from devtools.processes import (  # noqa: F401
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


class Redis(Process):
    """A Redis server of one test's own on a loopback port: a broker the test may stop and start
    again (empty, on the same port) without disturbing the one every other test shares."""

    def __init__(self, name: str, log_dir):
        self.port = free_port()
        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port)]
        argv += ["--save", "", "--appendonly", "no"]
        super().__init__(name, argv, dict(os.environ), log_dir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    ready_sign = "answer to PING"

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(16).startswith(b"+PONG")
        except OSError:
            return False
