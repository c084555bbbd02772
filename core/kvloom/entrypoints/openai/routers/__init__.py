"""The HTTP endpoints of the OpenAI-compatible server, one module per endpoint or group
(vLLM's ``api_router.py`` pattern).

Each module has:

* a module-level ``router = APIRouter(...)`` with its routes; a router whose endpoints run
  model code declares ``dependencies=[Depends(require_api_key)]``, so the API key is
  checked before the body is read;
* ``attach_router(app)``, which builds the module's serving object (an ``OpenAIServing*``
  from ``shared.server_context(app)``: the engine, the served models, the limits, the
  options), keeps it on ``app.state`` and includes the router (or not: ``lora`` attaches
  only when runtime LoRA updating is allowed);
* handlers that take the raw ``Request``, read the body with ``shared.read_body`` (the
  request limits; errors are OpenAI's 400s, never FastAPI's 422), find their serving
  object through ``request.app.state`` and answer with ``shared.answer`` (SSE or JSON,
  cancelled when the client disconnects).

Adding an endpoint: a new module here on this model (``tokenization.py`` is the smallest
with a body), one ``<module>.attach_router(app)`` line in ``api_server.build_app``, its
request and response schemas in ``protocol.py``, and its cases in the fuzz and hostile
request suites (``tests/entrypoints/openai/test_fuzz_server.py``,
``test_hostile_requests.py``).
"""
