"""KV transfer: the KV-connector contract (``base``), its config (``config``), moving blocks
(``blocks``) and choosing and building a connector (``factory``). The scheduler's part is
``kvloom.scheduler.kv_connector``, the model runner's ``kvloom.worker.kv_connector``;
``docs/kv_connectors.md`` tells the whole story."""
