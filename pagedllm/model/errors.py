"""ModelLoadError: a model file that is damaged, absurd or not what it claims to be.

A model file is untrusted input, like a request: whatever its bytes say, loading it ends in a
model or in one line naming the file and what is wrong with it, never in a traceback from deep
inside struct, numpy or transformers. It is a ValueError, so every entry point that already
answers bad input with "error: ..." answers a bad file the same way. read_json reads a model
folder's JSON files (config.json, an index) on the same terms.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LOW_LEVEL_ERRORS: tuple[type[BaseException], ...] = (
    struct.error,
    OverflowError,
    ZeroDivisionError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    UnicodeError,
    RecursionError,
    MemoryError,
)
"""What a reader that trusted a field raises on a file that lies: at the loading boundary these
become a ModelLoadError naming the file (the original kept as its cause, shown with -v)."""


class ModelLoadError(ValueError):
    """A model file (GGUF, config.json, safetensors, tokenizer) that cannot be loaded as it is:
    the message is one line that names the file, the field or tensor, and what is wrong."""


def one_line(error: BaseException) -> str:
    """An error's message on one line (a KeyError's quotes and a message's newlines gone)."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    text = " ".join(text.split()) or "no message"
    return text if len(text) <= 500 else text[:497] + "..."


def read_json(path: Path) -> Any:
    """A JSON file of a model folder; ModelLoadError naming it where it is not JSON."""
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelLoadError(f"{path}: not valid JSON ({type(error).__name__}: {error})") from None


@contextlib.contextmanager
def loading(source: str | Path) -> Iterator[None]:
    """Run a step of loading `source`: a low-level error from a field it trusted becomes a
    ModelLoadError naming `source`; ModelLoadError and the loader's own errors pass as they are."""
    try:
        yield
    except ModelLoadError:
        raise
    except LOW_LEVEL_ERRORS as error:
        kind = type(error).__name__
        raise ModelLoadError(
            f"{source}: damaged or not a model pagedllm reads ({kind}: {one_line(error)})"
        ) from error


@contextlib.contextmanager
def loading_tokenizer(folder: str | Path) -> Iterator[None]:
    """Load the tokenizer files of `folder`: whatever transformers or tokenizers raise on a
    damaged one (tokenizers' Rust errors are bare Exceptions) becomes a ModelLoadError naming the
    folder; a missing file (OSError) and pagedllm's own ValueErrors pass as they are."""
    try:
        yield
    except (ModelLoadError, OSError):
        raise
    except UnicodeError as error:
        raise ModelLoadError(f"{folder}: a tokenizer file is not UTF-8 text ({one_line(error)})") from error
    except ValueError:
        raise
    except Exception as error:
        kind = type(error).__name__
        raise ModelLoadError(
            f"{folder}: its tokenizer files are damaged or not ones transformers reads "
            f"({kind}: {one_line(error)})"
        ) from error
