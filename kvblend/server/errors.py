"""Errors as OpenAI sends them: {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error", code="invalid_api_key")


def not_found(message: str, param: str | None = None, code: str = "not_found") -> APIError:
    return APIError(404, message, param=param, code=code)


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body over the limit of {limit} bytes", code="body_too_large")


def overloaded(queue_size: int) -> APIError:
    return APIError(429, f"server busy: the request queue ({queue_size}) is full, retry later",
                    type="rate_limit_error", code="queue_full")


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
