"""One log format for the whole package: `INFO 11-29 10:52:13 [module] message`."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname)s %(asctime)s [%(module)s] %(message)s"


def configure_logging() -> None:
    """Give the `pagedllm` logger a stderr handler once (level: $PAGEDLLM_LOGGING_LEVEL, INFO)."""
    logger = logging.getLogger("pagedllm")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
