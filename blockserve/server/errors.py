"""Errors in OpenAI's nested shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause maps to a status here; validation errors are 400, never
FastAPI's 422.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockserve.errors import BlockserveError, InvalidRequestError
from blockserve.server.vllm_surface import is_vllm_route

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, as a response body or an SSE event."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        error = first["ctx"]["error"]
        message = str(error)  # our own check's words, without pydantic's prefix
        if isinstance(error, InvalidRequestError) and error.param is not None:
            return message, error.param  # a check that names its field says it whole
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {message}", None
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(BlockserveError)
    async def blockserve_error(request: Request, exc: BlockserveError) -> JSONResponse:
        retry_after = getattr(exc, "retry_after_s", None)
        headers = None if retry_after is None else {"Retry-After": str(retry_after)}
        return error_response(exc.http_status, str(exc), getattr(exc, "param", None), headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and "route" not in request.scope:  # no route matched
            return error_response(404, no_route_message(app, request.method, request.url.path))
        # Starlette's own headers ride along: `Allow` on a 405, for one.
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")


def no_route_message(app: FastAPI, method: str, path: str) -> str:
    """What a request for a route that does not exist is told: whether it is one of vLLM's,
    and the routes this server has."""
    served = sorted(
        f"{verb} {route.path}"
        for route in app.routes
        if isinstance(route, APIRoute)
        for verb in sorted(route.methods or ())
    )
    what = "is a vLLM route blockserve does not serve" if is_vllm_route(path) else "is no route"
    return f"{method} {path} {what}; this server serves {', '.join(served)}"


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_SCHEMA}}}


# What every operation may answer besides its own results, by the part of the server that says
# it: the body limit and the model check (POST only), the drain and a dead engine.
POST_ERRORS = {
    "400": "The request is malformed or out of range.",
    "404": "The request names a model this server does not serve.",
    "413": "The request body is larger than --max-request-body-bytes.",
}
ANY_ERRORS = {"503": "The server is draining, or its engine has died."}
GENERATION_ERRORS = {"500": "The model step failed for this request."}


def openapi_schema(app: FastAPI, open_paths: frozenset[str] | None = None) -> dict[str, Any]:
    """FastAPI's schema, corrected to what the server answers: a malformed body is a 400 in
    OpenAI's error shape, never FastAPI's 422, and every status a middleware or handler can
    give is listed (with API keys, `open_paths` given, a 401 on every other path). Built once
    and kept, as FastAPI does."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, item in schema["paths"].items():
            for method, operation in item.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                errors = {**ANY_ERRORS, **(POST_ERRORS if method == "post" else {})}
                if path.startswith("/v1/") and method == "post":
                    errors |= GENERATION_ERRORS
                if open_paths is not None and path not in open_paths:
                    errors["401"] = "The request lacks a valid API key."
                for status, description in errors.items():
                    responses.setdefault(status, _error_response(description))
        schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
        schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema
