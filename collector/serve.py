"""Runs the collector under uvicorn with JSON logs; what `kvtrace collector` calls."""

from __future__ import annotations

import logging
import sys
import time

import msgspec

from kvtrace.collector.service import Collector, CollectorConfig


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what log pipelines index without parsing rules."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return msgspec.json.encode(entry).decode()


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in ("kvtrace", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False


def serve(config: CollectorConfig, host: str = "127.0.0.1", port: int = 4318, log_level: str = "info") -> int:
    """Serve until SIGINT / SIGTERM, then drain the spool into the store before exiting."""
    import uvicorn

    from kvtrace.collector.app import create_app

    configure_logging(log_level)
    collector = Collector(config)
    app = create_app(collector)
    # Access logs stay off: request lines carry nothing the metrics do not, and never tokens.
    uvicorn.run(app, host=host, port=port, log_config=None, access_log=False, log_level=log_level,
                timeout_graceful_shutdown=int(config.drain_timeout_s))
    return 0
