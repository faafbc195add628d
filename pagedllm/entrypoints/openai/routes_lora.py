"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters changed at run time, as vLLM
serves them (registered only with --enable-lora and --allow-runtime-lora-updating, else a 404).

A load reads and checks the adapter in a thread (the event loop serves on meanwhile) and serves it
once it passed; an unload stops new requests from naming it, while those already running under it
finish (the engine keeps what they run on)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from pagedllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedllm.entrypoints.openai.serving_models import LoRAModule, ServedModels


def make_router(models: ServedModels) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        request = await asyncio.to_thread(models.check_adapter, LoRAModule(body.lora_name, body.lora_path))
        models.add_adapter(request)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        models.remove_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
