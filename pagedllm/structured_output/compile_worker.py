"""A grammar compile process: this module's main(), in a process worker_process.py forks (or
`python -m pagedllm.structured_output.compile_worker` by hand), started and killed by
GrammarCompilePool. It reads the vocabulary index, answers READY, then compiles one
grammar per request until its stdin closes.

Messages on stdin/stdout are frames: a status byte and an 8-byte big-endian length, then that
many bytes. In: the tokenizer info (xgrammar's JSON), then one `[kind, spec,
disable_any_whitespace]` JSON per grammar. Out: READY once, then per grammar OK with the
compiled grammar's JSON or INVALID with the 400 message. A PING frame (empty) is answered
READY: the pool's check that an idle process still reads. Anything else the process or xgrammar
prints goes to stderr (the server's log).
"""

from __future__ import annotations

import json
import signal
import struct
import sys
from typing import BinaryIO

HEADER = struct.Struct(">cQ")
READY, OK, INVALID, REQUEST, PING = b"R", b"O", b"I", b"Q", b"P"


def write_frame(stream: BinaryIO, status: bytes, payload: bytes = b"") -> None:
    stream.write(HEADER.pack(status, len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> tuple[bytes, bytes] | None:
    """(status, payload), or None at end of stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    status, size = HEADER.unpack(header)
    return status, stream.read(size)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the reply stream
    import xgrammar

    from pagedllm.structured_output.backend import compile_grammar

    first = read_frame(requests)
    if first is None:
        return
    info = xgrammar.TokenizerInfo.deserialize_json(first[1].decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_frame(replies, READY)
    while (frame := read_frame(requests)) is not None:
        if frame[0] == PING:
            write_frame(replies, READY)
            continue
        kind, spec, disable_any_whitespace = json.loads(frame[1])
        try:
            compiled = compile_grammar(compiler, (kind, spec, disable_any_whitespace), info.vocab_size)
        except ValueError as error:
            write_frame(replies, INVALID, str(error).encode())
            continue
        write_frame(replies, OK, compiled.serialize_json().encode())


if __name__ == "__main__":
    main()
