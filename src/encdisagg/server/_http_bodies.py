"""The HTTP bodies of the encoder routes: reading a request's JSON, answering JSON and errors.

Every helper here reads or builds Quart's request context objects; none holds state.
"""

from __future__ import annotations

import json
from typing import Final

import anyio
from quart import Response, current_app, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from .._errors import BadRequestError, EncdisaggError
from ..nurseries import run_thread_to_completion
from ._client_watch import read_body
from ._json import decode_body, shown

__all__ = [
    "error_response",
    "http_error_response",
    "json_response",
    "read_json",
    "require_json_type",
]

#: Bodies larger than this are decoded in a worker thread, off the event loop.
_THREAD_DECODE_BYTES: Final = 256 * 1024


class _UnsupportedMediaType(EncdisaggError):
    status = 415


def require_json_type() -> None:
    """Refuse a body that is not declared JSON: a browser sends text/plain, form and
    multipart bodies across sites without asking, never application/json.

    :raises EncdisaggError: with status 415.
    """
    if request.mimetype != "application/json":
        given = request.headers.get("Content-Type")
        raise _UnsupportedMediaType(
            "Content-Type must be application/json; got "
            + ("none" if given is None else shown(given))
        )


async def read_json(limit: int, limiter: anyio.CapacityLimiter | None) -> object:
    """The request's JSON body. A checkpoint; large bodies are decoded off the loop.

    :raises RequestEntityTooLarge: over ``limit`` (or the app's ``MAX_CONTENT_LENGTH``).
    :raises BadRequestError: empty, or not JSON.
    """
    if request.content_length is not None and request.content_length > limit:
        raise RequestEntityTooLarge()
    data = await read_body()
    if len(data) > limit:
        raise RequestEntityTooLarge()
    if not data.strip():
        raise BadRequestError("the request body is empty; expected a JSON object")
    if len(data) > _THREAD_DECODE_BYTES:
        return await run_thread_to_completion(decode_body, data, limiter=limiter)
    return decode_body(data)


def json_response(payload: object, status: int = 200) -> Response:
    response: Response = current_app.response_class(
        json.dumps(payload), status=status, content_type="application/json"
    )
    return response


#: Seconds a 503 asks its client to wait before trying again.
_RETRY_AFTER_S: Final = "1"


def error_response(status: int, message: str, req_id: str | None) -> Response:
    response = json_response({"status": "error", "message": message, "req_id": req_id}, status)
    if status == 503:
        # Over a memory budget, shutting down, no live worker: all pass; say when to retry.
        response.headers["Retry-After"] = _RETRY_AFTER_S
    return response


def http_error_response(exc: HTTPException, limit: int) -> Response:
    status = exc.code or 500
    if isinstance(exc, RequestEntityTooLarge):
        message = f"the request body is larger than the limit of {limit} bytes"
    else:
        message = exc.description or exc.name
    return error_response(status, message, None)
