"""The server's LoRA adapters (vLLM's --lora-modules and its /v1/*_lora_adapter routes).

Owns: reading --lora-modules (`name=path`, or the JSON form {"name", "path",
"base_model_name"}), the adapters' model cards in /v1/models (`parent`: the base model), and
POST /v1/load_lora_adapter and /v1/unload_lora_adapter, installed only when the environment
variable JAXLLM_ALLOW_RUNTIME_LORA_UPDATING is true (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
A bad path or adapter config is a 400 (the engine's check, which loads the adapter); a name
that is taken is a 400; unloading an unknown name is a 404.

Unloading with requests in flight: they finish with the adapter (their requests carry it,
and its device slot is reused only once they have left); new requests naming it get the
404 of an unknown model. The registry itself is the engine's LoRA manager
(jaxllm/lora/manager.py). Never generates.
"""

from __future__ import annotations

import json
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from jaxllm.lora.request import LoRARequest

RUNTIME_UPDATING_ENV = "JAXLLM_ALLOW_RUNTIME_LORA_UPDATING"


def parse_lora_modules(values: list[str] | None) -> list[dict]:
    """--lora-modules entries -> [{"name", "path", "base_model_name"}]."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: invalid JSON {value!r}: {e}") from None
            if not isinstance(spec, dict) or not {"name", "path"} <= set(spec) or (
                    set(spec) - {"name", "path", "base_model_name"}):
                raise ValueError(f"--lora-modules: the JSON form takes the keys name, path "
                                 f"and base_model_name, got {value!r}")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: expected name=path or JSON, got {value!r}")
            spec = {"name": name, "path": path}
        modules.append({"base_model_name": None, **spec})
    return modules


def register_lora_modules(engine, modules: list[dict], base_names: list[str]) -> None:
    """Load the --lora-modules adapters at start-up (a bad one stops the server)."""
    manager = engine.engine.lora_manager
    for spec in modules:
        if spec["name"] in base_names:
            raise ValueError(f"--lora-modules: {spec['name']!r} is a served model name")
        manager.add_lora(LoRARequest(spec["name"], manager.next_id(), spec["path"],
                                     spec["base_model_name"]))


def lora_cards(engine, base_name: str) -> list[dict]:
    """/v1/models entries of the adapters (vLLM's: root is the path, parent the base)."""
    return [_card(lr, base_name) for lr in engine.engine.lora_manager.list_loras()]


def lora_card(engine, name: str, base_name: str) -> dict | None:
    """/v1/models/{name} of an adapter (None: `name` is no adapter)."""
    lora = engine.engine.lora_manager.get_lora(name)
    return None if lora is None else _card(lora, base_name)


def _card(lora: LoRARequest, base_name: str) -> dict:
    return {"id": lora.lora_name, "object": "model", "created": 0, "owned_by": "jaxllm",
            "root": lora.lora_path, "parent": lora.base_model_name or base_name}


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")


def install_lora_routes(app: FastAPI, engine, base_names: list[str], api_error) -> None:
    if not runtime_updating_allowed():
        return
    manager = engine.engine.lora_manager

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        if not body.lora_name or not body.lora_path:
            raise api_error(400, "Both 'lora_name' and 'lora_path' must be provided.",
                            "BadRequestError", None)
        if body.lora_name in base_names:
            raise api_error(400, f"The lora adapter '{body.lora_name}' conflicts with a "
                                 "served base model.", "BadRequestError", "lora_name")
        if manager.config is None:
            raise api_error(400, "LoRA is not enabled: start the server with --enable-lora",
                            "BadRequestError", None)
        try:
            lora = LoRARequest(body.lora_name, manager.next_id(), body.lora_path)
            await engine.offload(manager.add_lora, lora)
        except ValueError as e:
            raise api_error(400, str(e), "BadRequestError", "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        if manager.get_lora(body.lora_name) is None:
            raise api_error(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                            "NotFoundError", "lora_name")
        manager.remove_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")
