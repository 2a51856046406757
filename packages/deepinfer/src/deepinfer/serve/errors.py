"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with their status codes.

A request's own mistake is a 4xx naming the field; 500 is only for a failure of the server itself.
"""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model {model!r} does not exist", "invalid_request_error", "model", "model_not_found"
    )


def unauthorized() -> APIError:
    return APIError(
        401,
        "Missing or invalid API key (Authorization: Bearer KEY)",
        "invalid_request_error",
        None,
        "invalid_api_key",
    )


def overloaded(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "engine_overloaded")


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error")


_FIELD = re.compile(r"^([A-Za-z_]+)")


def from_value_error(e: ValueError, fields: dict[str, str]) -> APIError:
    """A ValueError of the engine or of `SamplingParams` as a 400 naming the request's field: its
    message starts with the engine's name for it, `fields` maps that name to the request's."""
    message = str(e)
    m = _FIELD.match(message)
    param = fields.get(m.group(1)) if m else None
    return bad_request(message, param)


def _loc(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def from_validation_errors(errors: list[dict]) -> APIError:
    """pydantic's complaints about a body as a 400 naming the first field at fault."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc(tuple(first.get("loc", ())))
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return bad_request(message, param or None)


def install_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return from_validation_errors(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type_).response()
