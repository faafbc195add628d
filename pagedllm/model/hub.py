"""Models by Hugging Face hub name: `ORG/NAME`, or vLLM's `ORG/NAME:QUANT` for one GGUF of several.

The order a vLLM user expects: the local cache first (huggingface_hub's HF_HUB_CACHE / HF_HOME, or
--download-dir), read without a network call; a download only when that misses and HF_HUB_OFFLINE
is not set, and then only the files the engine reads. A miss, offline or not, is one
HubModelNotFoundError that names the repo, the cache, offline mode and what to do.

huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE once, at import; its `constants` module is
the one place pagedllm reads them from, so the two never disagree.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError, RepositoryNotFoundError

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Config, generation defaults, tokenizer and chat template: fetched with the weights or without them.
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


class HubModelNotFoundError(FileNotFoundError):
    """A hub model that is neither cached nor downloadable; the message says what to do."""


def is_hub_model(model: str) -> bool:
    """`ORG/NAME` or `ORG/NAME:QUANT`, what vLLM reads as a hub name once no local path has the name
    (`dir/file.gguf` stays a path, so a missing file is reported as one)."""
    return _REPO_ID.fullmatch(model) is not None and not model.endswith(".gguf")


def hub_cache_dir(download_dir: str | None) -> Path:
    """--download-dir, else huggingface_hub's cache (HF_HUB_CACHE, else HF_HOME/hub)."""
    return Path(download_dir or constants.HF_HUB_CACHE).expanduser()


def hub_model_path(
    model: str, *, revision: str | None = None, download_dir: str | None = None, weights: bool = True
) -> Path:
    """The cached snapshot folder of hub model `model`, or its one .gguf file, downloading on a miss.

    Args:
        revision: branch, tag or commit; None is the repo's `main`.
        weights: False where only config and tokenizer are read (the planner, --tokenizer), so a
            safetensors repo downloads no weight file.
    """
    repo_id, _, quant = model.partition(":")
    cache_dir = hub_cache_dir(download_dir)
    snapshot = _cached_snapshot(repo_id, revision, cache_dir)
    path = _usable(snapshot, model, quant, weights) if snapshot else None
    if path is not None:
        logger.info("Model %s from the Hugging Face cache: %s", model, path)
        return path
    miss = _Miss(model, repo_id, revision, cache_dir, is_cached=snapshot is not None)
    if constants.is_offline_mode():
        raise miss.error()
    snapshot = _download(miss, quant, weights)
    path = _usable(snapshot, model, quant, weights)
    if path is None:
        raise miss.error("the downloaded files hold no config.json with weights")
    return path


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir: Path) -> Path | None:
    """The snapshot folder the cache holds for `revision`, whole or in part, without a network call."""
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except IncompleteSnapshotError as error:
        return Path(error.snapshot_path)  # files we never fetched (other GGUFs, onnx/) are missing too
    except LocalEntryNotFoundError:
        return None


def _usable(snapshot: Path, model: str, quant: str, weights: bool) -> Path | None:
    """`snapshot` when it holds config.json (and, with `weights`, every safetensors file), else its one
    matching .gguf; None when the snapshot lacks what the engine reads."""
    has_config = not quant and (snapshot / "config.json").is_file()
    if has_config and (not weights or _has_safetensors(snapshot)):
        return snapshot
    gguf = _one_gguf([p.name for p in snapshot.glob("*.gguf")], model, quant)
    return snapshot / gguf if gguf else None


def _has_safetensors(folder: Path) -> bool:
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        return all((folder / name).is_file() for name in _index_shards(index))
    return any(folder.glob("*.safetensors"))


def _index_shards(index: Path) -> list[str]:
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def _one_gguf(names: list[str], model: str, quant: str) -> str | None:
    """The .gguf among `names` ending in `quant` (any, without one); None if none. Raises ValueError
    when several match, naming them and how to pick one."""
    ggufs = sorted(n for n in names if n.lower().endswith(f"{quant}.gguf".lower()))
    if len(ggufs) > 1:
        repo_id = model.partition(":")[0]
        raise ValueError(
            f"model {model!r}: the repo has {len(ggufs)} .gguf files ({', '.join(ggufs)}); pick one "
            f"by its quantization as {repo_id}:QUANT (e.g. {repo_id}:Q4_K_M), or pass a local .gguf file"
        )
    return ggufs[0] if ggufs else None


def _download(miss: _Miss, quant: str, weights: bool) -> Path:
    """Fetch only the files the engine reads into the cache; returns the snapshot folder."""
    with miss.on_network_error():
        info = HfApi().model_info(miss.repo_id, revision=miss.revision)
    names = [s.rfilename for s in info.siblings or [] if "/" not in s.rfilename]
    if quant or not any(n.endswith(".safetensors") for n in names):
        gguf = _one_gguf(names, miss.model, quant)
        if gguf is None:
            found = f"no .gguf file ending in {quant}.gguf" if quant else "no *.safetensors and no .gguf file"
            raise miss.error(f"the hub repo has {found} (files: {', '.join(names) or 'none'})")
        files = [gguf]
    else:
        files = [n for n in names if n in SMALL_FILES]
        if weights:
            with miss.on_network_error():
                files += _weight_files(miss, names)
    logger.info("Downloading %s (revision %s) into %s", miss.model, miss.revision or "main", miss.cache_dir)
    with miss.on_network_error():
        folder = snapshot_download(
            miss.repo_id, revision=miss.revision, cache_dir=miss.cache_dir, allow_patterns=files
        )
    return Path(folder)


def _weight_files(miss: _Miss, names: list[str]) -> list[str]:
    """The safetensors files to fetch: the index's shards where there is one (Mistral-style repos
    also carry a consolidated.safetensors that would load twice), else all of them."""
    if SAFETENSORS_INDEX not in names:
        return [n for n in names if n.endswith(".safetensors")]
    index = hf_hub_download(miss.repo_id, SAFETENSORS_INDEX, revision=miss.revision, cache_dir=miss.cache_dir)
    return [SAFETENSORS_INDEX, *_index_shards(Path(index))]


@dataclass(frozen=True)
class _Miss:
    """A hub model the cache could not serve: what the user is told, whatever went wrong next."""

    model: str
    repo_id: str
    revision: str | None
    cache_dir: Path
    is_cached: bool

    def error(self, failure: str | None = None) -> HubModelNotFoundError:
        revision = self.revision or "main"
        where = f"the Hugging Face cache {self.cache_dir} (HF_HUB_CACHE / HF_HOME, or --download-dir)"
        state = (
            f"is in {where} but without the files the engine reads"
            if self.is_cached
            else f"is not in {where}"
        )
        offline = constants.is_offline_mode()
        why = (
            "offline mode is on (HF_HUB_OFFLINE=1), so nothing was downloaded"
            if offline
            else f"offline mode is off and the download failed: {failure}"
        )
        command = f"hf download {self.repo_id}" + (f" --revision {self.revision}" if self.revision else "")
        return HubModelNotFoundError(
            f"model {self.model!r} is not a local path, and hub repo {self.repo_id} (revision {revision}) "
            f"{state}; {why}. To fix: run `{command} --cache-dir {self.cache_dir}` on a machine with "
            "network (copying that folder here if this one has none)"
            + (", unset HF_HUB_OFFLINE to let pagedllm download it" if offline else "")
            + ", or pass a local model folder or .gguf file"
        )

    @contextmanager
    def on_network_error(self) -> Iterator[None]:
        """No route, DNS, 401/403/404, gated repo, 5xx: whatever the hub client raises becomes error()."""
        try:
            yield
        except Exception as error:  # every failure gets the one clear message, never a traceback
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            hint = " (a private or gated repo needs `hf auth login` or HF_TOKEN)"
            hint = hint if isinstance(error, RepositoryNotFoundError) else ""
            raise self.error(f"{type(error).__name__}: {first_line}{hint}") from error
