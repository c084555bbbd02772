"""How one request crosses the router: its prefill on a prefill instance, then its decode on
a decode instance, linked through ``kv_transfer_params`` (as vLLM's disaggregated-serving
proxies do).

* ``prefill_request(body)``: the client's body with ``max_tokens`` (and chat's
  ``max_completion_tokens``) 1, ``stream`` false, ``min_tokens`` and ``stream_options``
  left out (they would contradict one non-streamed token), and ``kv_transfer_params``
  asking the prefill's connector to keep the KV for a remote decode;
* ``decode_request(body, params)``: the client's body as it came, with the prefill
  response's ``kv_transfer_params`` (when it had some) for the decode's connector;
* ``send(...)``: a request to the next instance of a role that is up; one that cannot be
  connected to is marked down and the next one is tried.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import httpx

from kvloom.entrypoints.openai.errors import APIError
from kvloom.entrypoints.router.instances import Instance, InstancePool, describe_error, is_connect_error

logger = logging.getLogger(__name__)

#: What the prefill's connector is asked for (vLLM's fields): keep the prompt's KV for a
#: decode elsewhere; the connector fills in where it is (the ``remote_*`` fields).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Request headers passed on to the instances (the API key, the request's id).
FORWARDED_HEADERS = ("authorization", "x-api-key", "x-request-id")
#: Response headers passed back to the client.
RETURNED_HEADERS = ("content-type", "cache-control")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The body that only prefills ``body``'s prompt on a prefill instance."""
    prefill = {key: value for key, value in body.items() if key not in ("stream_options", "min_tokens")}
    prefill.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    if body.get("max_completion_tokens") is not None:
        prefill["max_completion_tokens"] = 1
    return prefill


def decode_request(body: dict[str, Any], prefill_response: Any) -> dict[str, Any]:
    """``body`` for the decode instance: with the prefill's ``kv_transfer_params`` when its
    response (parsed JSON) has some, else as the client sent it without any."""
    decode = {key: value for key, value in body.items() if key != "kv_transfer_params"}
    params = prefill_response.get("kv_transfer_params") if isinstance(prefill_response, dict) else None
    if isinstance(params, dict) and params:
        decode["kv_transfer_params"] = params
    return decode


def forwarded_headers(headers: Any, request_id: str) -> dict[str, str]:
    """The client's headers an instance needs, with the router's id for the request."""
    out = {name: headers[name] for name in FORWARDED_HEADERS if name in headers}
    out["x-request-id"] = request_id
    return out


def returned_headers(response: httpx.Response) -> dict[str, str]:
    return {name: response.headers[name] for name in RETURNED_HEADERS if name in response.headers}


def unavailable(pool: InstancePool, role: str) -> APIError:
    """The 503 for a role none of whose instances can be reached."""
    return APIError(pool.unavailable_message(role), status=HTTPStatus.SERVICE_UNAVAILABLE,
                    code=int(HTTPStatus.SERVICE_UNAVAILABLE), type="service_unavailable_error")  # fmt: skip


async def send(pool: InstancePool, role: str, method: str, path: str, headers: dict[str, str],
               body: dict[str, Any] | None = None) -> tuple[Instance, httpx.Response]:  # fmt: skip
    """``method path`` on the next instance of ``role`` that is up, the response's body not
    read yet (the caller reads or streams it, then closes it). An instance that cannot be
    connected to is marked down and the next is tried; with none left, a 503 naming them.
    An instance that fails after the request reached it is a 502 naming it (the request
    is not sent twice)."""
    for instance in await pool.up_in_turn(role):
        request = pool.client.build_request(method, instance.url + path, json=body, headers=headers)
        try:
            return instance, await pool.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            if is_connect_error(exc):
                pool.mark_down(instance, describe_error(exc))
                continue
            logger.warning("%s instance %s failed on %s %s: %s", role, instance.url, method, path, describe_error(exc))
            raise APIError(f"{role} instance {instance.url} failed: {describe_error(exc)}",
                           status=HTTPStatus.BAD_GATEWAY, code=int(HTTPStatus.BAD_GATEWAY)) from None  # fmt: skip
    raise unavailable(pool, role)


async def read_all(instance: Instance, response: httpx.Response) -> bytes:
    """The rest of ``response``'s body (a 502 naming ``instance`` if it breaks off)."""
    try:
        return await response.aread()
    except httpx.HTTPError as exc:
        raise APIError(f"{instance.role} instance {instance.url} failed while answering: {describe_error(exc)}",
                       status=HTTPStatus.BAD_GATEWAY, code=int(HTTPStatus.BAD_GATEWAY)) from None  # fmt: skip
    finally:
        await response.aclose()


async def prefill(pool: InstancePool, path: str, body: dict[str, Any],
                  headers: dict[str, str]) -> tuple[httpx.Response, bytes, Any]:  # fmt: skip
    """Prefill ``body`` on a prefill instance: its response, body and (for a 200) the body
    parsed as JSON."""
    instance, response = await send(pool, "prefill", "POST", path, headers, prefill_request(body))
    content = await read_all(instance, response)
    if response.status_code != HTTPStatus.OK:
        return response, content, None
    try:
        return response, content, json.loads(content)
    except ValueError:
        raise APIError(f"prefill instance {instance.url} answered {path} with a body that is not JSON",
                       status=HTTPStatus.BAD_GATEWAY, code=int(HTTPStatus.BAD_GATEWAY)) from None  # fmt: skip


async def relay_stream(instance: Instance, response: httpx.Response) -> AsyncIterator[bytes]:
    """``response``'s server-sent events as they come; if the instance breaks off, an error
    event and ``[DONE]`` end the stream (its status is already sent). Closing the iterator
    (the client went away) closes the instance's connection, which aborts its request."""
    try:
        async for chunk in response.aiter_bytes():
            yield chunk
    except httpx.HTTPError as exc:
        logger.warning("%s instance %s broke off a stream: %s", instance.role, instance.url, describe_error(exc))
        error = APIError(f"{instance.role} instance {instance.url} broke off the stream: {describe_error(exc)}",
                         status=HTTPStatus.BAD_GATEWAY, code=int(HTTPStatus.BAD_GATEWAY))  # fmt: skip
        yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
    finally:
        await response.aclose()
