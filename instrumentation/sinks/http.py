"""Posts batches to a kvtrace collector in the versioned msgpack wire format, or as columns.

Rows (msgpack) use only the standard library and msgspec: this sink runs inside engine
processes, where every added dependency is a possible version conflict with the engine's own,
and rows are the cheapest to make there. Columns (an Arrow IPC stream, `schema.arrow_wire`)
cost the sender more and the collector much less: the choice for a fleet whose collectors, not
its engines, are short of CPU. pyarrow is imported only when columns are asked for.
"""

from __future__ import annotations

import gzip
import http.client
import urllib.error
import urllib.request
from enum import StrEnum

from kvtrace.instrumentation.sinks.base import OK, AnyBatch, ExportResult, ExportStatus
from kvtrace.schema.wire import CONTENT_TYPE, Batch, encode_batch

INGEST_PATH = "/v1/batches"
INSTANCE_HEADER = "X-Kvtrace-Instance"
_TRANSIENT = {408, 425, 429, 500, 502, 503, 504}


class Wire(StrEnum):
    ROWS = "rows"  # msgpack rows: cheapest for the engine
    COLUMNS = "columns"  # an Arrow IPC stream: cheapest for the collector


def _encode_rows(batch: AnyBatch) -> tuple[bytes, str]:
    return encode_batch(batch), CONTENT_TYPE


def _gzip(body: bytes) -> tuple[bytes, str]:
    return gzip.compress(body, compresslevel=1), "gzip"


def _zstd(body: bytes) -> tuple[bytes, str]:
    import pyarrow as pa

    return pa.compress(body, "zstd", asbytes=True), "zstd"


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0  # an HTTP date: fall back to our own backoff


class HttpSink:
    """At-least-once delivery: a batch is re-sent until the collector acknowledges it; the
    collector de-duplicates by event id. 429 / 503 answers are honoured with their Retry-After.
    """

    def __init__(self, url: str, token: str = "", timeout_s: float = 10.0, compress: bool = True,
                 wire: Wire | str = Wire.ROWS) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"collector URL {url!r} must start with http:// or https://")
        try:
            self.wire = Wire(wire)
        except ValueError:
            raise ValueError(f"wire {wire!r} is not one of {', '.join(w.value for w in Wire)}") from None
        self._encode = _encode_rows
        self._compress = _gzip
        # Rows go as encoded: a journal's records are sent as they are, never decoded here.
        self.takes_encoded = self.wire is Wire.ROWS
        if self.wire is Wire.COLUMNS:
            from kvtrace.schema.arrow_wire import ARROW_TYPE, Envelope, encode_columns

            def columns(batch: Batch) -> tuple[bytes, str]:
                envelope = Envelope(source_id=batch.source_id, batch_seq=batch.batch_seq, sent_ns=batch.sent_ns,
                                    stats=batch.stats)
                try:
                    return encode_columns(envelope, batch.events), ARROW_TYPE
                except (OverflowError, TypeError, ValueError):  # ArrowInvalid is a ValueError
                    # An event whose value its column cannot hold (a shim bug): rows carry it,
                    # and the collector quarantines that event alone instead of the batch
                    # failing on every retry.
                    return _encode_rows(batch)

            self._encode = columns
            # pyarrow is loaded anyway: its zstd costs a fifth of gzip's CPU for the same size.
            self._compress = _zstd
        self.url = url.rstrip("/") + INGEST_PATH if not url.rstrip("/").endswith(INGEST_PATH) else url
        self._token = token
        self.timeout_s = timeout_s
        self.compress = compress

    def export(self, batch: AnyBatch) -> ExportResult:
        body, content_type = self._encode(batch)  # type: ignore[arg-type]
        headers = {"Content-Type": content_type, "User-Agent": "kvtrace-emitter"}
        if self.compress:
            body, headers["Content-Encoding"] = self._compress(body)
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if batch.stats is not None and batch.stats.instance:  # lets a load balancer keep an instance on one collector
            headers[INSTANCE_HEADER] = "".join(c for c in batch.stats.instance if " " <= c <= "~")
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
            return OK
        except urllib.error.HTTPError as exc:
            detail = f"HTTP {exc.code} from {self.url}: {exc.read(512).decode('utf-8', 'replace')}"
            status = ExportStatus.RETRY if exc.code in _TRANSIENT else ExportStatus.FAILURE
            return ExportResult(status, retry_after_s=_retry_after(exc.headers.get("Retry-After")), detail=detail)
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            return ExportResult(ExportStatus.RETRY, detail=f"cannot reach {self.url}: {exc}")

    def shutdown(self) -> None:
        return None
