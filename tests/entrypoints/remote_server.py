"""Run `jaxllm serve` for real: a subprocess on a free port, ready when /health says so.

Owns starting, waiting for and stopping (SIGTERM, as an operator would) one server. Never
mocks anything: the tests talk to it over loopback with the openai client and httpx.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, args: list[str], *, env: dict | None = None, timeout: float = 600,
                 log_level: str = "warning", launcher: list[str] | None = None):
        """launcher: the command that takes `serve ARGS` (default: jaxllm's CLI)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = launcher or [sys.executable, "-c",
                                "from jaxllm.entrypoints.cli import main; main()"]
        cmd = [*launcher, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port),
               "--uvicorn-log-level", log_level]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.proc.stdout.read()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("server did not become healthy")

    def stop(self) -> int:
        """SIGTERM, then wait: the graceful path; -> the exit code (uvicorn re-raises the
        signal after its graceful shutdown, so a clean stop exits with -SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log = self.proc.stdout.read()
        self.proc.stdout.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Unlabelled-by-reason values of /metrics: {name{labels}: value}."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def value(self, name: str, **labels) -> float:
        """The value of one metric, summed over series matching `labels`."""
        total = 0.0
        for key, v in self.metrics().items():
            if key.split("{")[0] == name and all(f'{k}="{val}"' in key
                                                 for k, val in labels.items()):
                total += v
        return total
