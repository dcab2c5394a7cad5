"""vLLM's runtime adapter routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--enable-lora).

A client names a folder for the server to read, so loading is off unless the operator names the folder adapters may
come from (`--lora-dir DIR`): a `lora_path` is resolved (symlinks too) and must lie inside it. The adapter is read and
checked off the event loop and the engine thread, then registered; a bad one is a 400 naming what is wrong and
leaves the base model and every other adapter as they were. Unloading one that running requests use lets them finish
with it; new requests can no longer name it."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from sieve.lora import LoRAError
from sieve.server.errors import APIError
from sieve.server.routes import require_api_key, state

lora_api = APIRouter(dependencies=[Depends(require_api_key)])
LORA_PATHS = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


def manager_of(request: Request):
    manager = state(request).engine.lora
    if manager is None:
        raise APIError(400, "this server serves no LoRA adapters (start it with --enable-lora)", code="lora_disabled")
    return manager


def confined(root: str | None, path: str) -> str:
    """`path` (relative to `root`, or absolute) once it is known to lie inside `root`."""
    if root is None:
        raise APIError(400, "loading adapters at run time is off: start the server with --lora-dir DIR, the folder they "
                            "may be read from", param="lora_path", code="lora_loading_disabled")
    base = Path(root).resolve()
    target = (base / path).resolve()
    if not target.is_relative_to(base):
        raise APIError(400, "lora_path must lie inside the server's --lora-dir", param="lora_path")
    return str(target)


@lora_api.post("/v1/load_lora_adapter")
async def load_adapter(body: LoadAdapter, request: Request):
    st, manager = state(request), manager_of(request)
    path = confined(st.options.lora_dir, body.lora_path)
    if body.lora_name == st.model_name:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
    try:
        adapter = await st.off_loop(manager.read, body.lora_name, path)
        manager.register(adapter)
    except LoRAError as e:
        raise APIError(400, str(e).replace(str(Path(st.options.lora_dir).resolve()), "--lora-dir"), param="lora_path",
                       code="invalid_lora") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@lora_api.post("/v1/unload_lora_adapter")
async def unload_adapter(body: UnloadAdapter, request: Request):
    manager = manager_of(request)
    try:
        manager.unregister(body.lora_name)
    except LoRAError as e:
        raise APIError(404, str(e), param="lora_name", code="lora_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
