"""The names the server answers to (--served-model-name and its LoRA adapters) and `/v1/models`.

With --enable-lora a request names an adapter in `model`, as vLLM's clients do; `--lora-modules`
names the adapters served from the start, and POST /v1/load_lora_adapter and
/v1/unload_lora_adapter change them at run time (--allow-runtime-lora-updating, or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING). Each adapter loaded gets a fresh id (by which it takes a slot;
the prefix cache keys it by its files' fingerprint: lora_request.py).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from http import HTTPStatus

from pagedllm import limits
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList
from pagedllm.lora.checker import LoRAChecker
from pagedllm.lora_request import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModule]:
    """`name=path` or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}` each.
    Raises ValueError naming the entry."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                module = LoRAModule(entry["name"], entry["path"], entry.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(
                    f"--lora-modules: {value!r} is not JSON with a name and a path ({error})"
                ) from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r}: give name=path")
            module = LoRAModule(name, path)
        if not isinstance(module.name, str) or not isinstance(module.path, str):
            raise ValueError(f"--lora-modules: {value!r}: name and path must be strings")
        modules.append(module)
    return modules


class ServedModels:
    def __init__(
        self, names: list[str], root: str, max_model_len: int, lora_checker: LoRAChecker | None = None
    ) -> None:
        """`lora_checker`: the engine's, with --enable-lora (None: no adapters)."""
        self.names = names
        self.root = root
        self.max_model_len = max_model_len
        self.lora_checker = lora_checker
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def resolve(self, requested: str | None) -> str:
        """The name to echo in responses; 404 for a name this server does not serve."""
        if requested is None:
            return self.names[0]
        if requested not in self.names and requested not in self.adapters:
            served = [*self.names, *self.adapters]
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"The model `{requested}` does not exist; this server serves {', '.join(served)}",
                param="model",
                code="model_not_found",
            )
        return requested

    def lora_request(self, name: str) -> LoRARequest | None:
        """The adapter a resolved name runs under; None for the base model."""
        return self.adapters.get(name)

    def check_adapter(self, module: LoRAModule) -> LoRARequest:
        """Read and check the adapter (blocking: a thread's work at run time), under a fresh id.
        Raises APIError: 400 for a name in use or a bad adapter, 404 for a path with none."""
        if self.lora_checker is None:
            raise APIError(HTTPStatus.BAD_REQUEST, "LoRA is off: start the server with --enable-lora")
        self._check_name_free(module.name)
        limits.check_text("lora_path", module.path)
        try:
            request = LoRARequest(
                module.name, next(self._ids), module.path, module.base_model_name or self.names[0]
            )
        except ValueError as error:
            raise APIError(HTTPStatus.BAD_REQUEST, str(error), param="lora_name") from None
        try:
            request = self.lora_checker.check(request)
        except ValueError as error:
            status = HTTPStatus.NOT_FOUND if "no such adapter" in str(error) else HTTPStatus.BAD_REQUEST
            raise APIError(
                status, f"Cannot load LoRA adapter {module.name!r}: {error}", param="lora_path"
            ) from None
        return request

    def add_adapter(self, request: LoRARequest) -> None:
        """Serve a checked adapter under its name (on the event loop, after check_adapter)."""
        self._check_name_free(request.lora_name)
        self.adapters[request.lora_name] = request

    def remove_adapter(self, name: str) -> None:
        """Stop serving an adapter; requests already running under it finish. 404 if unknown."""
        request = self.adapters.pop(name, None)
        if request is None:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"The lora adapter {name!r} cannot be found.",
                param="lora_name",
                code="model_not_found",
            )
        assert self.lora_checker is not None  # adapters exist only with it
        self.lora_checker.forget(request.lora_int_id)

    def list(self) -> ModelList:
        cards = [ModelCard(id=name, root=self.root, max_model_len=self.max_model_len) for name in self.names]
        cards += [
            ModelCard(
                id=name,
                root=request.lora_path,
                parent=request.base_model_name,
                max_model_len=self.max_model_len,
            )
            for name, request in self.adapters.items()
        ]
        return ModelList(data=cards)

    def _check_name_free(self, name: str) -> None:
        if name in self.adapters or name in self.names:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"The lora adapter {name!r} has already been loaded.",
                param="lora_name",
            )
