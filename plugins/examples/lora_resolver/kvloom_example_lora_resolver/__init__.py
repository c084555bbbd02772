"""IndexFileResolver: LoRA adapters by name, from the JSON index file ``$KVLOOM_LORA_INDEX``.

The index maps adapter names to PEFT adapter directories::

    {"sql": "/srv/adapters/sql-lora", "chat-fr": "/srv/adapters/chat-fr"}

It is read on every call, so adapters can be added while the server runs.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from kvloom.interfaces import LoRARequest, LoRAResolver, read_adapter_config, validate_adapter_config

KVLOOM_PLUGIN_API = "1.0"

INDEX_ENV = "KVLOOM_LORA_INDEX"


class IndexFileResolver(LoRAResolver):
    def __init__(self) -> None:  # kvloom builds resolvers with no arguments
        self.index_env = INDEX_ENV

    def _index(self) -> dict[str, str]:
        value = os.environ.get(self.index_env)
        if not value:
            return {}  # not configured: this resolver has no adapters
        try:
            index = json.loads(Path(value).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.index_env}={value}: cannot read the adapter index ({exc})") from None
        if not isinstance(index, dict):
            raise ValueError(f"{self.index_env}={value}: expected a JSON object of adapter name -> path")
        return index

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        path = self._index().get(lora_name)
        if path is None:
            return None  # not ours: kvloom asks the next resolver, else answers 404
        # Known but unusable: raise ValueError (the client gets a 400 with the message).
        config = read_adapter_config(path, lora_name)
        # Like the server, this does not hold the adapter to the base model it records
        # (base_model_name is the served name, often an alias); pass
        # base_model_name=base_model_name to refuse adapters recorded for another model.
        validate_adapter_config(config, name=lora_name)
        lora_id = zlib.crc32(lora_name.encode()) % (2**31 - 1) + 1  # any positive int
        return LoRARequest(lora_name=lora_name, lora_int_id=lora_id, lora_path=str(path),
                           base_model_name=base_model_name)  # fmt: skip
