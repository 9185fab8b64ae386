"""Posts batches to a kvtrace collector in the versioned msgpack wire format.

Uses only the standard library: this sink runs inside engine processes, where every added
dependency is a possible version conflict with the engine's own.
"""

from __future__ import annotations

import gzip
import http.client
import urllib.error
import urllib.request

from kvtrace.instrumentation.sinks.base import OK, ExportResult, ExportStatus
from kvtrace.schema.wire import CONTENT_TYPE, Batch, encode_batch

INGEST_PATH = "/v1/batches"
INSTANCE_HEADER = "X-Kvtrace-Instance"
_TRANSIENT = {408, 425, 429, 500, 502, 503, 504}


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0  # an HTTP date: fall back to our own backoff


class HttpSink:
    """At-least-once delivery: a batch is re-sent until the collector acknowledges it; the
    collector de-duplicates by event id. 429 / 503 answers are honoured with their Retry-After.
    """

    def __init__(self, url: str, token: str = "", timeout_s: float = 10.0, compress: bool = True) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"collector URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/") + INGEST_PATH if not url.rstrip("/").endswith(INGEST_PATH) else url
        self._token = token
        self.timeout_s = timeout_s
        self.compress = compress

    def export(self, batch: Batch) -> ExportResult:
        body = encode_batch(batch)
        headers = {"Content-Type": CONTENT_TYPE, "User-Agent": "kvtrace-emitter"}
        if self.compress:
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
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
