"""A real `bitguard serve` in a subprocess on a free loopback port, for API and browser tests.

The server is the same `serve()` the CLI runs; limits can be lowered through ServerConfig so
that the size checks are cheap to exercise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    workspace: str
    process: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def start_server(workspace: str, config: dict | None = None, timeout: float = 30.0, preamble: str = "") -> LiveServer:
    """`preamble`: Python the server process runs first (a test's stand-in for part of the engine)."""
    port = free_port()
    code = (preamble + "import json, sys\n"
            "from bitguard.backend.server import ServerConfig, serve\n"
            "serve(sys.argv[1], '127.0.0.1', int(sys.argv[2]), ServerConfig(**json.loads(sys.argv[3])))\n")
    os.makedirs(workspace, exist_ok=True)
    log_path = os.path.join(workspace, "..", f"server-{port}.log")
    log = open(log_path, "w")  # noqa: SIM115 - the child writes into it until stopped
    proc = subprocess.Popen([sys.executable, "-c", code, workspace, str(port), json.dumps(config or {})],
                            stdout=log, stderr=subprocess.STDOUT)
    server = LiveServer(f"http://127.0.0.1:{port}", workspace, proc, os.path.abspath(log_path))
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"bitguard serve exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.url + "/api/health", timeout=1) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"bitguard serve did not answer within {timeout}s:\n{server.log()}")
        time.sleep(0.05)
