"""WorkerProcess: one grammar compile process (compile_worker.py) and its pipes, as the compile
pool drives it: start it (READY once the vocabulary index is loaded), ping it, ask it for one
compile at a time, kill it.

A process is forked from the forkserver (pagedllm/forkserver.py) and runs its module's main()
with the pipes for its stdin and stdout. Where the compile processes started the forkserver, it
imported xgrammar (and with it torch and transformers) once: a server's first compile process pays
those imports, a later one (after a compile cut at its timeout, or a process that died) does not.
Where a tensor-parallel server started it for its ranks (torch imported), each compile process
imports xgrammar and transformers itself. Like every forkserver child it first runs the server's
main module again (under its `__main__` guard, importing what the forkserver has not)."""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from pagedllm.forkserver import forkserver_context, run_in_environment
from pagedllm.structured_output import compile_worker
from pagedllm.structured_output.compile_worker import HEADER

logger = logging.getLogger(__name__)

COMPILE_PRELOAD = ["xgrammar", compile_worker.__name__]
"""What the forkserver imports for compile processes, if they are the first to start it."""


class WorkerProcess:
    """One compile process and its pipes (the frames of compile_worker)."""

    def __init__(
        self,
        process: BaseProcess,
        replies: asyncio.StreamReader,
        replies_pipe: asyncio.ReadTransport,
        requests: asyncio.StreamWriter,
    ) -> None:
        self._process = process
        self._replies = replies
        self._replies_pipe = replies_pipe
        self._requests = requests
        self._killed = False

    @classmethod
    async def start(cls, module: str, tokenizer_info: bytes, running: set[WorkerProcess]) -> WorkerProcess:
        """A ready worker running `module`'s main(), in `running` from its start (so that closing
        the pool kills it). RuntimeError if it answers anything but READY."""
        loop = asyncio.get_running_loop()
        requests_read, requests_write = os.pipe()
        replies_read, replies_write = os.pipe()
        child_ends = [Connection(requests_read, writable=False), Connection(replies_write, readable=False)]
        replies = asyncio.StreamReader()
        replies_pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(replies), os.fdopen(replies_read, "rb", buffering=0)
        )
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()),
            os.fdopen(requests_write, "wb", buffering=0),
        )
        process = forkserver_context(COMPILE_PRELOAD).Process(
            target=run_in_environment,
            args=(dict(os.environ), _run_main, module, *child_ends),
            name="pagedllm-grammar-compile",
            daemon=True,
        )
        requests = asyncio.StreamWriter(transport, protocol, None, loop)
        worker = cls(process, replies, replies_pipe, requests)
        running.add(worker)
        # in a thread: the forkserver's first start imports its preload before it forks
        starting = asyncio.ensure_future(asyncio.to_thread(_start, process, child_ends))
        try:
            await asyncio.shield(starting)
            if worker._killed:  # the pool closed while it started
                raise EOFError("the grammar compile process was killed as it started")
            status, _ = await worker.ask(tokenizer_info)
            if status != compile_worker.READY:
                raise RuntimeError(f"the grammar compile process answered {status!r} instead of READY")
        except BaseException:
            worker.kill()
            if not starting.done():  # cancelled (a start timeout) while it started: kill it once started
                starting.add_done_callback(lambda _: worker.kill())
            running.discard(worker)
            raise
        logger.debug("Started grammar compile process %d", process.pid)
        return worker

    @property
    def pid(self) -> int | None:
        """None until the process has started."""
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """None while the process runs (or has not started)."""
        return self._process.exitcode

    async def ask(self, request: bytes, kind: bytes = compile_worker.REQUEST) -> tuple[bytes, bytes]:
        """Send one frame, read one back: (status, payload)."""
        self._requests.write(HEADER.pack(kind, len(request)) + request)
        await self._requests.drain()
        status, size = HEADER.unpack(await self._replies.readexactly(HEADER.size))
        return status, await self._replies.readexactly(size)

    async def ping(self) -> None:
        """Return once the process answers (it is idle and reading); RuntimeError for a wrong answer."""
        status, _ = await self.ask(b"", compile_worker.PING)
        if status != compile_worker.READY:
            raise RuntimeError(f"the grammar compile process answered {status!r} to a ping")

    async def wait(self) -> int | None:
        """The exit code, once the process has ended (after `kill`: at once)."""
        await asyncio.to_thread(self._process.join)
        return self._process.exitcode

    def kill(self) -> None:
        """SIGKILL, and the pipes closed (a read under way ends with IncompleteReadError)."""
        self._killed = True
        if self._process.pid is not None and self._process.exitcode is None:
            self._process.kill()
        self._requests.close()
        self._replies_pipe.close()


def _start(process: BaseProcess, child_ends: list[Connection]) -> None:
    """Start the process, then close this process's copies of its pipe ends (so that either side
    reads EOF when the other goes)."""
    try:
        process.start()
    finally:
        for end in child_ends:
            end.close()


def _run_main(module: str, requests: Connection, replies: Connection) -> None:
    """In the child: `module`'s main(), with `requests` for its stdin and `replies` for its stdout."""
    os.dup2(requests.fileno(), 0)
    os.dup2(replies.fileno(), 1)
    requests.close()
    replies.close()
    # held here for main()'s whole run, as sys.__stdin__ / __stdout__ hold them in a fresh
    # interpreter: a main() that rebinds sys.stdout (compile_worker's does) keeps its stream open
    streams = open(0, closefd=False), open(1, "w", closefd=False)  # noqa: SIM115
    sys.stdin, sys.stdout = streams
    importlib.import_module(module).main()
