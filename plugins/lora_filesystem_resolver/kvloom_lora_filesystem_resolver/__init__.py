"""FilesystemResolver: LoRA adapter NAME is the PEFT directory $KVLOOM_LORA_RESOLVER_CACHE_DIR/NAME.

kvloom asks it when a request names a model the server does not know (and the server runs
with ``--enable-lora`` and ``KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1``). It answers:

* None when ``NAME/adapter_config.json`` does not exist (the adapter is not here; other
  resolvers may have it, else the client gets a 404);
* a ``LoRARequest`` when the config is one kvloom can run: ``peft_type`` LORA, supported
  target modules (kvloom then loads the weights, checks the rank against
  ``--max-lora-rank`` and the matrices against the model's projections). Like the server
  (and vLLM's server), it does not hold the adapter to the base model its config records:
  the served name is often an alias of the model;
* ``ValueError`` naming the problem otherwise, and when the cache directory is not set
  or is not a directory.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from kvloom.interfaces import (
    ADAPTER_CONFIG_FILE,
    LoRARequest,
    LoRAResolver,
    read_adapter_config,
    validate_adapter_config,
)

KVLOOM_PLUGIN_API = "1.0"

CACHE_DIR_ENV = "KVLOOM_LORA_RESOLVER_CACHE_DIR"


class FilesystemResolver(LoRAResolver):
    def _cache_dir(self) -> Path:
        # Read per call: the variable belongs to the server's environment, which tests
        # and operators may set after kvloom has loaded its plugins.
        value = os.environ.get(CACHE_DIR_ENV)
        if not value or not Path(value).is_dir():
            raise ValueError(
                f"{CACHE_DIR_ENV} must be set to a valid directory for the filesystem LoRA resolver "
                f"(it is {value!r})"
            )
        return Path(value)

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        cache_dir = self._cache_dir()
        if not lora_name or lora_name in (".", "..") or "/" in lora_name or os.sep in lora_name:
            raise ValueError(f"{lora_name!r} is not a valid adapter name (a directory name in {CACHE_DIR_ENV})")
        path = cache_dir / lora_name
        if not (path / ADAPTER_CONFIG_FILE).is_file():
            return None  # LoRA adapter not found here
        config = read_adapter_config(path, lora_name)
        validate_adapter_config(config, name=lora_name)
        # A stable id per name (the server assigns its own ids when it registers adapters).
        lora_id = zlib.crc32(lora_name.encode()) % (2**31 - 1) + 1
        return LoRARequest(lora_name=lora_name, lora_int_id=lora_id, lora_path=str(path),
                           base_model_name=base_model_name)  # fmt: skip
