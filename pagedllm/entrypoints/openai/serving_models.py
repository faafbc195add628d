"""The names the server answers to (--served-model-name) and `/v1/models`."""

from __future__ import annotations

from http import HTTPStatus

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList


class ServedModels:
    def __init__(self, names: list[str], root: str, max_model_len: int) -> None:
        self.names = names
        self.root = root
        self.max_model_len = max_model_len

    def resolve(self, requested: str | None) -> str:
        """The name to echo in responses; 404 for a name this server does not serve."""
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"The model `{requested}` does not exist; this server serves {', '.join(self.names)}",
                param="model",
                code="model_not_found",
            )
        return requested

    def list(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=name, root=self.root, max_model_len=self.max_model_len) for name in self.names]
        )
