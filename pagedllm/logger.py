"""One log format for the whole package: `INFO 11-29 10:52:13 [module] message`."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname)s %(asctime)s [%(module)s] %(message)s"


def configure_logging(process: str = "") -> None:
    """Give the `pagedllm` logger a stderr handler once (level: $PAGEDLLM_LOGGING_LEVEL, INFO);
    `process` names a worker process in each line (`[rank 1]`)."""
    logger = logging.getLogger("pagedllm")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    text = _FORMAT.replace("[%(module)s]", f"[{process}] [%(module)s]") if process else _FORMAT
    handler.setFormatter(logging.Formatter(text, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
