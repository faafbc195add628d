"""A pagedllm server in a child process, for benchmarks that need one of their own.

It listens on a free port (the URL is read from its start-up line, never guessed) and its
memory can be read while it runs (resident set size, children included).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import psutil

READY_LINE = "Serving the OpenAI API on "


class ServerProcess:
    """`python -m pagedllm.entrypoints.openai.api_server ARGS --port 0`; `stop()` when done."""

    def __init__(self, args: list[str], log_path: str | Path | None = None, timeout_s: float = 300.0) -> None:
        command = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", *args, "--port", "0"]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url: str | None = None
        self._log = open(log_path, "w") if log_path else None  # noqa: SIM115 (closed in stop)
        self._ready = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._ready.wait(timeout_s) or self.url is None:
            self.stop()
            raise RuntimeError(
                f"the server did not start within {timeout_s:.0f} s (exit code {self.proc.poll()})"
            )

    def _read_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self._log is not None:
                self._log.write(line)
                self._log.flush()
            if self.url is None and READY_LINE in line:
                self.url = line.split(READY_LINE)[1].split()[0]
                self._ready.set()
        self._ready.set()  # it exited

    def rss_bytes(self) -> int:
        """Resident memory of the server and any processes it started."""
        try:
            root = psutil.Process(self.proc.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            return 0

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
        return self.proc.returncode
