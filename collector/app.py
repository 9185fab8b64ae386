"""The collector's HTTP API (FastAPI): ingest, tenant-scoped queries, health and metrics.

Every refusal is JSON `{"error": ...}` naming the cause, with a 4xx (or 429/503 with
Retry-After when the collector cannot take more now). OpenAPI docs are at `/docs`; the batch
body's schema there is the one derived from the event Struct.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvtrace.collector.auth import Grant
from kvtrace.collector.intake import ENVELOPE_BOUNDS, JSON_TYPE, PROTOBUF_TYPE, IntakeError, Unavailable, media_type
from kvtrace.collector.service import Collector
from kvtrace.schema.arrow_wire import ARROW_TYPE
from kvtrace.schema.clickhouse import EVENTS, VERDICTS
from kvtrace.schema.events import WIRE_REQUIRED
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.verdicts import COUNTED_SQL, READMITTED_SQL
from kvtrace.schema.wire import CONTENT_TYPE, WIRE_VERSION, Batch

log = logging.getLogger("kvtrace.collector")
MAX_ROWS = 10_000
_INT_PARAMS = {"limit", "since_ns"}
INT64_MAX = 2**63 - 1


class RowProblem(BaseModel):
    row: int
    field: str
    reason: str


class IngestReply(BaseModel):
    received: int
    accepted: int
    quarantined: int
    problems: list[RowProblem]  # the first 100 quarantined rows, with why


class ErrorReply(BaseModel):
    error: str


class HitRates(BaseModel):
    """Counted as the engine counts its prefix-cache hits: each request once, at its first
    admission. A request preempted and admitted again is counted apart (`readmitted_*`); unsafe
    reuse counts every adopted lookup."""

    key: str
    lookups: int
    prompt_tokens: int
    logical_hit_tokens: int
    recoverable_hit_tokens: int
    adopted_tokens: int
    unsafe_reuse: int
    logical_rate: float
    recoverable_rate: float
    adopted_rate: float
    readmissions: int = 0
    readmitted_prompt_tokens: int = 0
    readmitted_adopted_tokens: int = 0


class GroupBy(StrEnum):
    MODEL = "model"
    INSTANCE = "instance"
    TENANT = "tenant"


def _otlp_list(camel: str, snake: str, item: dict[str, Any]) -> dict[str, Any]:
    """An OTLP/JSON repeated field, which protobuf's JSON mapping accepts under either name, but
    not under both at once; null for the field means empty, while an element is an object, never
    null."""
    field = {"type": ["array", "null"], "items": item}
    return {"properties": {camel: field, snake: field}, "not": {"required": [camel, snake]}}


_LOG_RECORDS = {"type": "object", **_otlp_list("logRecords", "log_records", {"type": "object"})}
_SCOPE_LOGS = {"type": "object", **_otlp_list("scopeLogs", "scope_logs", _LOG_RECORDS)}
# What /v1/logs parses of a JSON body (ExportLogsServiceRequest): the records' path; the rest of
# the document is ignored. Declared so a client (and the API fuzzer) knows what is refused.
_OTLP_JSON: dict[str, Any] = {"type": "object", **_otlp_list("resourceLogs", "resource_logs", _SCOPE_LOGS)}

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorReply, "description": text}
    for code, text in ((400, "malformed request"), (401, "missing or unknown token"),
                       (403, "outside the token's tenants"), (413, "body too large"),
                       (415, "unsupported media type"), (422, "bad parameters"),
                       (429, "spool full, retry after"), (503, "shutting down or spool unwritable"))
}


def _error(status: int, message: str, retry_after_s: int = 0) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": 'Bearer realm="kvtrace"'}
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message


def _grant(collector: Collector, request: Request) -> Grant:
    for name, value in request.query_params.multi_items():
        # pydantic reads "3\r" as 3; a number that is not just a number is refused, not guessed at
        if name in _INT_PARAMS and value != value.strip():
            raise _Refused(422, f"query parameter {name!r}: surrounding whitespace in {value!r}")
    grant = collector.authenticate(request.headers.get("authorization"))
    if grant is None:
        collector.refused("unauthenticated", 401)
        raise _Refused(401, "missing or unknown bearer token")
    return grant


async def _body(request: Request, limit: int) -> bytes:
    """The raw body, refused (413) before a byte of it is read when its Content-Length is over
    the limit, and as soon as it passes the limit when it comes chunked. A client that hangs up
    mid-body is not an error of the collector: nothing was acknowledged, so nothing is lost."""
    declared = request.headers.get("content-length", "")
    if declared.strip().isdigit() and int(declared) > limit:
        raise _Refused(413, f"Content-Length {int(declared)} is over the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _Refused(413, f"body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise _Gone() from None
    return b"".join(chunks)


class _Gone(Exception):
    """The client went away before its body arrived; there is no one to answer."""


def _tenant_filter(grant: Grant, params: dict[str, Any]) -> str:
    if grant.operator:
        return "1"
    params["tenants"] = sorted(grant.tenants)
    return "tenant IN {tenants:Array(String)}"


def _link_reads(spec: dict[str, Any]) -> None:
    """OpenAPI links from an accepted batch to the reads that return it (the events and verdicts
    of its first row's instance, the rates): what a client does next, and what a stateful API
    fuzzer follows."""
    ops = {(path, method): op for path, item in spec.get("paths", {}).items() for method, op in item.items()}
    post = ops.get(("/v1/batches", "post"))
    if post is None:
        return
    links = {}
    for name, path in (("ReadEvents", "/v1/events"), ("ReadVerdicts", "/v1/verdicts"), ("ReadRates", "/v1/hit-rates")):
        target = ops.get((path, "get"))
        if target is None:
            continue
        link: dict[str, Any] = {"operationId": target["operationId"]}
        if path != "/v1/hit-rates":
            link["parameters"] = {"instance": "$request.body#/events/0/instance"}
        links[name] = link
    post["responses"]["200"]["links"] = links


def create_app(collector: Collector, manage_lifecycle: bool = True) -> FastAPI:
    """The ASGI app. With `manage_lifecycle`, it starts the collector and drains it at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await run_in_threadpool(collector.start)
        yield
        if manage_lifecycle:
            await run_in_threadpool(collector.stop)

    app = FastAPI(title="kvtrace collector", version="0.1.0", lifespan=lifespan,
                  description="Ingest for kvtrace KV-cache lifecycle events: kvtrace batches and OTLP logs.")
    limit = collector.config.max_request_bytes

    @app.exception_handler(_Refused)
    async def refused(_: Request, exc: _Refused) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(_Gone)
    async def gone(_: Request, exc: _Gone) -> Response:
        log.info("a client disconnected before its request body arrived; nothing was accepted")
        return Response(status_code=499)  # nginx's "client closed request": never sent, only logged

    @app.exception_handler(RequestValidationError)
    async def bad_params(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()]
        return _error(422, "; ".join(parts) or "invalid parameters")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        out = _error(exc.status_code, str(exc.detail))
        out.headers.update(exc.headers or {})  # e.g. Allow on a 405
        return out

    # -- ingest ------------------------------------------------------------------------------
    async def _ingest(request: Request, otlp: bool) -> Any:
        """(intake, foreign records) once spooled, or the refusal to answer with."""
        grant = _grant(collector, request)
        body = await _body(request, limit)
        try:
            result = await run_in_threadpool(collector.ingest, body, request.headers.get("content-type"),
                                             request.headers.get("content-encoding"), grant, otlp)
        except IntakeError as exc:
            collector.refused(grant.name, exc.status)
            raise _Refused(exc.status, exc.message) from None
        except Unavailable as exc:
            collector.refused(grant.name, exc.status)
            return _error(exc.status, exc.message, exc.retry_after_s)
        return result

    @app.post("/v1/batches", response_model=IngestReply, responses=_ERRORS, summary="Ingest a kvtrace batch",
              openapi_extra={"requestBody": {"required": True, "content": {
                  CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}},
                  ARROW_TYPE: {"schema": {"type": "string", "format": "binary"}},
                  JSON_TYPE: {"schema": {"$ref": "#/components/schemas/Batch"}}}}})
    async def post_batch(request: Request) -> Any:
        """A batch in the emitter's wire format (msgpack rows), as columns (an Arrow IPC stream
        of the event schema, envelope as JSON in the schema metadata key `kvtrace.batch`) or in
        its JSON form, optionally gzip'd. Good rows are stored and bad ones quarantined; the
        reply counts both and says why."""
        result = await _ingest(request, otlp=False)
        if isinstance(result, Response):
            return result
        intake, _ = result
        return IngestReply(received=intake.received, accepted=intake.accepted, quarantined=intake.quarantined,
                           problems=[RowProblem(row=r.row, field=r.field, reason=r.reason)
                                     for r in intake.batch.rejections[:100]])

    @app.post("/v1/logs", summary="Ingest OTLP/HTTP logs carrying kvtrace events",
              responses={**_ERRORS, 200: {"description": "ExportLogsServiceResponse, in the request's encoding",
                                          "content": {PROTOBUF_TYPE: {}, JSON_TYPE: {}}}},
              openapi_extra={"requestBody": {"required": True, "content": {
                  PROTOBUF_TYPE: {"schema": {"type": "string", "format": "binary"}},
                  JSON_TYPE: {"schema": _OTLP_JSON}}}})
    async def post_logs(request: Request) -> Any:
        """OTLP ExportLogsServiceRequest (protobuf or JSON); answers an ExportLogsServiceResponse
        whose partial_success counts and explains the records not stored."""
        from google.protobuf import json_format
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

        result = await _ingest(request, otlp=True)
        if isinstance(result, Response):
            return result
        intake, foreign = result
        reply = ExportLogsServiceResponse()
        if intake.quarantined:
            first = intake.batch.rejections[0]
            reply.partial_success.rejected_log_records = intake.quarantined
            reply.partial_success.error_message = (
                f"{intake.quarantined} kvtrace events invalid (quarantined); first: record {first.row}: "
                f"{first.field + ': ' if first.field else ''}{first.reason}")
        elif foreign:
            reply.partial_success.error_message = f"{foreign} records were not kvtrace events and were skipped"
        if media_type(request.headers.get("content-type")) == PROTOBUF_TYPE:
            return Response(reply.SerializeToString(), media_type=PROTOBUF_TYPE)
        return Response(json_format.MessageToJson(reply), media_type=JSON_TYPE)

    # -- queries (each one sees only the token's tenants) ------------------------------------
    def _rows(sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        return collector.store.query_arrow(sql, params).to_pylist()

    async def _select(request: Request, table: str, filters: dict[str, str | None], since_ns: int,
                      limit: int) -> Response:
        """Rows of one table for the token's tenants, in stream order, filtered by equality."""
        grant = _grant(collector, request)
        params: dict[str, Any] = {"since": since_ns, "limit": limit}
        where = [_tenant_filter(grant, params), "ts_ns >= {since:Int64}"]
        for name, value in filters.items():
            if value is not None:
                params[name] = value
                where.append(f"{name} = {{{name}:String}}")
        sql = (f"SELECT * FROM {collector.store.db}.{table} FINAL WHERE {' AND '.join(where)} "
               "ORDER BY ts_ns, source_id, seq LIMIT {limit:UInt32}")
        rows = await run_in_threadpool(_rows, sql, params)
        return Response(msgspec.json.encode(rows), media_type=JSON_TYPE)

    @app.get("/v1/events", responses=_ERRORS, summary="Stored events of the token's tenants")
    async def get_events(
        request: Request,
        instance: str | None = None,
        request_id: str | None = None,
        kind: EventKind | None = None,
        since_ns: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_ROWS)] = 1000,
    ) -> Response:
        filters = {"instance": instance, "request_id": request_id, "kind": kind.value if kind else None}
        return await _select(request, EVENTS.name, filters, since_ns, limit)

    @app.get("/v1/verdicts", responses=_ERRORS, summary="Live per-lookup verdicts of the token's tenants")
    async def get_verdicts(
        request: Request,
        instance: str | None = None,
        request_id: str | None = None,
        since_ns: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_ROWS)] = 1000,
    ) -> Response:
        return await _select(request, VERDICTS.name, {"instance": instance, "request_id": request_id}, since_ns, limit)

    @app.get("/v1/hit-rates", response_model=list[HitRates], responses=_ERRORS,
             summary="Logical, recoverable and adopted hit rates from the live verdicts")
    async def get_hit_rates(
        request: Request,
        by: GroupBy = GroupBy.MODEL,
        since_ns: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
    ) -> list[HitRates]:
        grant = _grant(collector, request)
        params: dict[str, Any] = {"since": since_ns}
        where = f"{_tenant_filter(grant, params)} AND ts_ns >= {{since:Int64}} AND adopt_seen"
        # Aliased apart from the columns: ClickHouse resolves a column name to a same-named alias,
        # and the re-admissions' sums read the columns the first admissions' sums are named after.
        sums = {"lookups": f"countIf({COUNTED_SQL})", "unsafe_reuse": "countIf(unsafe_reuse)",
                "readmissions": f"countIf({READMITTED_SQL})",
                **{c: f"sumIf({c}, {COUNTED_SQL})" for c in ("prompt_tokens", "logical_hit_tokens",
                                                              "recoverable_hit_tokens", "adopted_tokens")},
                **{f"readmitted_{c}": f"sumIf({c}, {READMITTED_SQL})" for c in ("prompt_tokens", "adopted_tokens")}}
        sql = (f"SELECT toString({by.value}) AS key, {', '.join(f'{e} AS n_{name}' for name, e in sums.items())} "
               f"FROM {collector.store.db}.{VERDICTS.name} FINAL WHERE {where} GROUP BY key ORDER BY key")
        rows = await run_in_threadpool(_rows, sql, params)
        out = []
        for r in rows:
            n = {name: int(r[f"n_{name}"]) for name in sums}
            total = max(1, n["prompt_tokens"])
            out.append(HitRates(key=r["key"], **n, logical_rate=n["logical_hit_tokens"] / total,
                                recoverable_rate=n["recoverable_hit_tokens"] / total,
                                adopted_rate=n["adopted_tokens"] / total))
        return out

    # -- operations --------------------------------------------------------------------------
    @app.get("/healthz", summary="Liveness: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: store reachable and spool below its bound",
             responses={503: {"description": "not ready"}})
    async def readyz() -> Response:
        r = collector.readiness()
        body = {"ready": r.ready, "store_ok": r.store_ok, "spool_pending_bytes": r.spool_pending_bytes,
                "spool_bound_bytes": r.spool_bound_bytes, "shutting_down": r.shutting_down, "detail": r.detail}
        return JSONResponse(body, status_code=200 if r.ready else 503)

    refusal = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorReply"}}}

    @app.get("/metrics", summary="Prometheus metrics (an operator token, unless made public)",
             response_class=PlainTextResponse,
             responses={401: {"description": "missing or unknown token", "content": refusal},
                        403: {"description": "not an operator token", "content": refusal}})
    async def metrics(request: Request) -> Response:
        """The collector's counters, labelled by tenant: a scrape needs an operator token (a
        Prometheus `authorization` credential) unless the collector runs with public metrics, so
        no client learns the names of other tenants."""
        if collector.config.tokens.enabled and not collector.config.public_metrics:
            if not _grant(collector, request).operator:
                raise _Refused(403, "/metrics names every tenant: it needs an operator token (or --public-metrics)")
        return Response(generate_latest(collector.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, components = msgspec.json.schema_components([Batch], ref_template="#/components/schemas/{name}")
            components["Event"]["required"] = list(WIRE_REQUIRED)
            # `rejections` is how the collector's own spool carries quarantined rows; senders
            # never set it (and it is ignored if they do), so it is not part of the request.
            del components["Batch"]["properties"]["rejections"]
            components.pop("Rejection", None)
            batch = components["Batch"]
            batch["required"] = sorted({*batch.get("required", ()), "wire_version"})  # receivers require it
            batch["properties"]["wire_version"] = {"type": "integer", "enum": [WIRE_VERSION]}
            for name, (low, high) in ENVELOPE_BOUNDS.items():
                batch["properties"][name] = {"type": "integer", "minimum": low, "maximum": high}
            spec.setdefault("components", {}).setdefault("schemas", {}).update(components)
            _link_reads(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
