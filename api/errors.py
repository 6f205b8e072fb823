"""How refusals look over HTTP: a status code and `{"detail": "<one line>"}` naming the
field, the quota or the shortfall. Malformed requests keep FastAPI's list of errors in
`detail` (each with its `loc`) and add `message`, the first of them as one line."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

from cpn.contracts.loading import format_location
from cpn.orchestration.errors import (
    Conflict,
    InvalidRequest,
    NeverFits,
    NotFound,
    QuotaExceeded,
    ServiceError,
    Unauthorized,
)

STATUS: dict[type[ServiceError], int] = {
    NotFound: 404,
    InvalidRequest: 422,
    NeverFits: 422,
    QuotaExceeded: 403,
    Conflict: 409,
    Unauthorized: 401,
}


def _location(loc: tuple[object, ...]) -> str:
    """The field as a job file would name it (`cpn.contracts.loading.format_location`:
    pydantic's union branch tags dropped), "body" for the whole body."""
    parts = tuple(
        p if isinstance(p, int) else int(str(p)) if str(p).isdigit() else str(p)
        for p in loc
        if p != "body"
    )
    return format_location(parts) or "body"


def validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    where = _location(tuple(first.get("loc", ())))
    # A model-level check names its field itself ("parallel.pp: 3 does not divide …").
    return msg if where == "body" and ":" in msg else f"{where}: {msg}"


def install(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        status = STATUS.get(type(exc), 400)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"detail": str(exc)}, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg")), "type": e.get("type")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": detail, "message": validation_message(exc)}, status_code=422)

    # Last resorts: every value is checked before it reaches the database (the body's
    # fields, ids, headers), so these mean a check is missing — still the client's 4xx
    # with one line, never a 500 with a traceback.
    @app.exception_handler(DataError)
    async def _unstorable(_request: Request, _exc: DataError) -> JSONResponse:
        return JSONResponse(
            {"detail": "request: a value cannot be stored by the registry's database"},
            status_code=422,
        )

    @app.exception_handler(IntegrityError)
    async def _conflict(_request: Request, _exc: IntegrityError) -> JSONResponse:
        return JSONResponse(
            {"detail": "the request conflicts with a concurrent change; retry"}, status_code=409
        )

    @app.exception_handler(OperationalError)
    async def _database(_request: Request, _exc: OperationalError) -> JSONResponse:
        return JSONResponse(
            {"detail": "the registry's database is unavailable; retry"},
            status_code=503,
            headers={"Retry-After": "1"},
        )
