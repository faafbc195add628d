"""One log format for the whole package: `INFO 11-29 10:52:13 [module] message`, on stderr."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname)s %(asctime)s [%(module)s] %(message)s"
LEVEL_ENV = "PAGEDLLM_LOGGING_LEVEL"


def configure_logging(process: str = "") -> None:
    """Give the `pagedllm` logger a stderr handler once (level: $PAGEDLLM_LOGGING_LEVEL, INFO);
    `process` names a worker process in each line (`[rank 1]`)."""
    logger = logging.getLogger("pagedllm")
    if logger.handlers:
        return
    handler = logging.StreamHandler()  # stderr: never mixed into a command's output on stdout
    text = _FORMAT.replace("[%(module)s]", f"[{process}] [%(module)s]") if process else _FORMAT
    handler.setFormatter(logging.Formatter(text, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get(LEVEL_ENV, "INFO").upper())
    logger.propagate = False


def configure_console_logging(verbose: bool) -> None:
    """For commands that stream text to a terminal (`chat`, `generate`): warnings only, unless
    `verbose` (-v) or $PAGEDLLM_LOGGING_LEVEL asks for more; set in the environment so that
    tensor-parallel rank processes follow."""
    if verbose:
        os.environ[LEVEL_ENV] = "INFO"
    else:
        os.environ.setdefault(LEVEL_ENV, "WARNING")
    configure_logging()
    # A first start builds the CPU kernels for about a minute: its two lines stay, or the
    # command would look hung.
    logging.getLogger("pagedllm.kernels.cpu_ops").setLevel(logging.INFO)
