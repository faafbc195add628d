"""WorkerProcess: one grammar compile process (compile_worker.py) and its pipes, as the compile
pool drives it: start it (READY once the vocabulary index is loaded), ping it, ask it for one
compile at a time, kill it."""

from __future__ import annotations

import asyncio
import logging
import sys

from pagedllm.structured_output import compile_worker
from pagedllm.structured_output.compile_worker import HEADER

logger = logging.getLogger(__name__)


class WorkerProcess:
    """One compile process and its pipes (the frames of compile_worker)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process

    @classmethod
    async def start(cls, module: str, tokenizer_info: bytes, running: set[WorkerProcess]) -> WorkerProcess:
        """A ready worker running `python -m module`, in `running` from its start (so that
        closing the pool kills it). RuntimeError if it answers anything but READY."""
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        worker = cls(process)
        running.add(worker)
        try:
            status, _ = await worker.ask(tokenizer_info)
            if status != compile_worker.READY:
                raise RuntimeError(f"the grammar compile process answered {status!r} instead of READY")
        except BaseException:
            worker.kill()
            running.discard(worker)
            raise
        logger.debug("Started grammar compile process %d", process.pid)
        return worker

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """None while the process runs (as far as the event loop has noticed)."""
        return self._process.returncode

    async def ask(self, request: bytes, kind: bytes = compile_worker.REQUEST) -> tuple[bytes, bytes]:
        """Send one frame, read one back: (status, payload)."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(HEADER.pack(kind, len(request)) + request)
        await self._process.stdin.drain()
        status, size = HEADER.unpack(await self._process.stdout.readexactly(HEADER.size))
        return status, await self._process.stdout.readexactly(size)

    async def ping(self) -> None:
        """Return once the process answers (it is idle and reading); RuntimeError for a wrong answer."""
        status, _ = await self.ask(b"", compile_worker.PING)
        if status != compile_worker.READY:
            raise RuntimeError(f"the grammar compile process answered {status!r} to a ping")

    async def wait(self) -> int:
        """The exit code, once the process has ended (after `kill`: at once)."""
        return await self._process.wait()

    def kill(self) -> None:
        if self._process.returncode is None:
            self._process.kill()
