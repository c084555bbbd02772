"""DirectoryLoRAResolver: adapter NAME is the PEFT directory $KVLOOM_TEST_LORA_DIR/NAME."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from kvloom.interfaces import LoRARequest, LoRAResolver

KVLOOM_PLUGIN_API = "1.0"


class DirectoryLoRAResolver(LoRAResolver):
    def __init__(self) -> None:
        root = os.environ.get("KVLOOM_TEST_LORA_DIR")
        self.root = Path(root) if root else None

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        if self.root is None:
            return None
        path = self.root / lora_name
        config_file = path / "adapter_config.json"
        if not config_file.is_file():
            return None
        config = json.loads(config_file.read_text())
        if config.get("peft_type") != "LORA":
            raise ValueError(f"adapter {lora_name}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
        # A stable positive id per name, so the same adapter keeps its prefix-cache identity.
        lora_id = zlib.crc32(lora_name.encode()) % (2**31 - 1) + 1
        return LoRARequest(
            lora_name=lora_name, lora_int_id=lora_id, lora_path=str(path), base_model_name=base_model_name
        )
