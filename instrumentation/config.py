"""Emitter settings, read once from the environment and validated loudly at start-up.

Variables (all optional; nothing is emitted unless KVTRACE_ENABLED is true):
  KVTRACE_ENABLED            1/true/yes to turn tracing on
  KVTRACE_SINK               store | collector | otlp | spool (default: picked from what is set)
  KVTRACE_DSN                store DSN for the store sink (chdb:///path or http(s)://...)
  KVTRACE_COLLECTOR_URL      collector base URL for the collector sink
  KVTRACE_TOKEN              bearer token for the collector
  KVTRACE_COLLECTOR_WIRE     rows (msgpack, the default: cheapest for the engine) | columns
                             (Arrow: costs the engine more, the collector much less)
  KVTRACE_OTLP_ENDPOINT      OTLP/HTTP logs endpoint for the otlp sink
  KVTRACE_SPOOL_DIR          directory for spool files
  KVTRACE_INSTANCE           instance name stamped on stats (default: hostname:pid)
  KVTRACE_TENANT             default tenant namespace shims use when the engine has none
  KVTRACE_SAMPLE_RATE        fraction of requests traced, 0 < rate <= 1 (default 1)
  KVTRACE_MAX_QUEUE_SIZE, KVTRACE_MAX_EXPORT_BATCH_SIZE, KVTRACE_SCHEDULE_DELAY_MILLIS
  KVTRACE_JOURNAL            auto (the default: on for the collector and spool sinks) | on | off:
                             events wait in a file-backed journal that outlives the process,
                             shipped by a detached process or the next start if it dies
  KVTRACE_JOURNAL_DIR        the journals' directory (default: <data dir>/journal; a restart
                             ships what dead emitters left there)
  KVTRACE_JOURNAL_MIB        one journal's size in MiB, reserved on disk (default 64)
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from kvtrace.instrumentation.api import Emitter, set_emitter
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter, JournalConfig
from kvtrace.instrumentation.sinks.base import Sink
from kvtrace.instrumentation.sinks.http import Wire
from kvtrace.instrumentation.switch import OFF


class SinkKind(StrEnum):
    STORE = "store"
    COLLECTOR = "collector"
    OTLP = "otlp"
    SPOOL = "spool"


class JournalMode(StrEnum):
    AUTO = "auto"  # on where events leave the process for another (collector, spool)
    ON = "on"
    OFF = "off"


class ConfigError(ValueError):
    """A setting is wrong; the message names the variable."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = OFF


@dataclass(frozen=True, slots=True)
class EmitterSettings:
    enabled: bool = False
    sink: SinkKind = SinkKind.SPOOL
    dsn: str = ""
    collector_url: str = ""
    collector_wire: Wire = Wire.ROWS
    token: str = field(default="", repr=False)
    otlp_endpoint: str = ""
    spool_dir: str = ""
    instance: str = ""
    tenant: str = ""
    sample_rate: float = 1.0
    batch: BatchConfig = BatchConfig()
    journal: JournalMode = JournalMode.AUTO
    journal_dir: str = ""
    journal_mib: int = 64

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EmitterSettings:
        env = os.environ if env is None else env

        def flag(name: str) -> bool:
            value = env.get(name, "").strip().lower()
            if value in _TRUE:
                return True
            if value in _FALSE:
                return False
            raise ConfigError(f"{name}={value!r}: expected 1/0, true/false, yes/no or on/off")

        def integer(name: str, default: int) -> int:
            raw = env.get(name, "")
            if not raw:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r}: expected an integer") from None

        raw_rate = env.get("KVTRACE_SAMPLE_RATE", "1")
        try:
            rate = float(raw_rate)
        except ValueError:
            raise ConfigError(f"KVTRACE_SAMPLE_RATE={raw_rate!r}: expected a number in (0, 1]") from None
        if not 0.0 < rate <= 1.0:
            raise ConfigError(f"KVTRACE_SAMPLE_RATE={raw_rate!r}: expected a number in (0, 1]")

        dsn = env.get("KVTRACE_DSN", "")
        url = env.get("KVTRACE_COLLECTOR_URL", "")
        raw_wire = env.get("KVTRACE_COLLECTOR_WIRE", "").strip().lower() or Wire.ROWS.value
        try:
            wire = Wire(raw_wire)
        except ValueError:
            raise ConfigError(f"KVTRACE_COLLECTOR_WIRE={raw_wire!r}: expected one of "
                              f"{', '.join(w.value for w in Wire)}") from None
        otlp = env.get("KVTRACE_OTLP_ENDPOINT", "")
        spool = env.get("KVTRACE_SPOOL_DIR", "")
        sink_name = env.get("KVTRACE_SINK", "").strip().lower()
        if sink_name:
            try:
                sink = SinkKind(sink_name)
            except ValueError:
                choices = ", ".join(k.value for k in SinkKind)
                raise ConfigError(f"KVTRACE_SINK={sink_name!r}: expected one of {choices}") from None
        else:
            sink = (
                SinkKind.COLLECTOR if url else SinkKind.STORE if dsn else SinkKind.OTLP if otlp else SinkKind.SPOOL
            )
        # BatchConfig is a slots dataclass: its class attributes are descriptors, not defaults.
        defaults = BatchConfig()
        batch_vars = ("KVTRACE_MAX_QUEUE_SIZE", "KVTRACE_MAX_EXPORT_BATCH_SIZE", "KVTRACE_SCHEDULE_DELAY_MILLIS")
        try:
            batch = BatchConfig(
                max_queue_size=integer("KVTRACE_MAX_QUEUE_SIZE", defaults.max_queue_size),
                max_export_batch_size=integer("KVTRACE_MAX_EXPORT_BATCH_SIZE", defaults.max_export_batch_size),
                schedule_delay_millis=integer("KVTRACE_SCHEDULE_DELAY_MILLIS", defaults.schedule_delay_millis),
            )
        except ValueError as exc:
            named = ", ".join(f"{n}={env[n]!r}" for n in batch_vars if env.get(n)) or "batch settings"
            raise ConfigError(f"{named}: {exc}") from None
        raw_journal = env.get("KVTRACE_JOURNAL", "").strip().lower()
        if raw_journal in ("", JournalMode.AUTO):
            journal = JournalMode.AUTO
        elif raw_journal in _TRUE or raw_journal == JournalMode.ON:
            journal = JournalMode.ON
        elif raw_journal in _FALSE:
            journal = JournalMode.OFF
        else:
            raise ConfigError(f"KVTRACE_JOURNAL={raw_journal!r}: expected auto, on or off")
        journal_mib = integer("KVTRACE_JOURNAL_MIB", 64)
        if journal_mib < 1:
            raise ConfigError(f"KVTRACE_JOURNAL_MIB={journal_mib}: expected at least 1")
        settings = cls(
            enabled=flag("KVTRACE_ENABLED"),
            sink=sink,
            dsn=dsn,
            collector_url=url,
            collector_wire=wire,
            token=env.get("KVTRACE_TOKEN", ""),
            otlp_endpoint=otlp,
            spool_dir=spool,
            instance=env.get("KVTRACE_INSTANCE", "") or f"{socket.gethostname()}:{os.getpid()}",
            tenant=env.get("KVTRACE_TENANT", ""),
            sample_rate=rate,
            batch=batch,
            journal=journal,
            journal_dir=env.get("KVTRACE_JOURNAL_DIR", ""),
            journal_mib=journal_mib,
        )
        settings.check()
        return settings

    @property
    def journaled(self) -> bool:
        """Whether events wait in a journal: by default where they leave the process for another
        (a collector, spool files), which a process that dies must not take its tail to."""
        if self.journal is JournalMode.AUTO:
            return self.sink in (SinkKind.COLLECTOR, SinkKind.SPOOL)
        return self.journal is JournalMode.ON

    def environment(self) -> dict[str, str]:
        """These settings as the variables `from_env` reads (the journal's shipper starts with
        them), so settings made in code reach it as settings read from the environment do."""
        out = {
            "KVTRACE_ENABLED": "1" if self.enabled else "0",
            "KVTRACE_SINK": self.sink.value,
            "KVTRACE_DSN": self.dsn,
            "KVTRACE_COLLECTOR_URL": self.collector_url,
            "KVTRACE_COLLECTOR_WIRE": self.collector_wire.value,
            "KVTRACE_TOKEN": self.token,
            "KVTRACE_OTLP_ENDPOINT": self.otlp_endpoint,
            "KVTRACE_SPOOL_DIR": self.spool_dir,
            "KVTRACE_INSTANCE": self.instance,
            "KVTRACE_TENANT": self.tenant,
            "KVTRACE_SAMPLE_RATE": repr(self.sample_rate),
            "KVTRACE_MAX_QUEUE_SIZE": str(self.batch.max_queue_size),
            "KVTRACE_MAX_EXPORT_BATCH_SIZE": str(self.batch.max_export_batch_size),
            "KVTRACE_SCHEDULE_DELAY_MILLIS": str(self.batch.schedule_delay_millis),
            "KVTRACE_JOURNAL": self.journal.value,
            "KVTRACE_JOURNAL_DIR": self.journal_dir,
            "KVTRACE_JOURNAL_MIB": str(self.journal_mib),
        }
        if not out["KVTRACE_SPOOL_DIR"] and self.sink is SinkKind.SPOOL:
            out["KVTRACE_SPOOL_DIR"] = default_spool_dir()
        return out

    def journal_config(self) -> JournalConfig | None:
        """The emitter's journal, with a detached shipper, or None when events wait in memory."""
        if not self.journaled:
            return None
        from functools import partial

        from kvtrace.schema.paths import data_dir

        return JournalConfig(directory=self.journal_dir or str(data_dir() / "journal"),
                             size_bytes=self.journal_mib << 20, shipper=partial(start_shipper, env=self.environment()))

    def check(self) -> None:
        if not self.enabled:
            return
        if self.sink is SinkKind.COLLECTOR and not self.collector_url:
            raise ConfigError("KVTRACE_SINK=collector needs KVTRACE_COLLECTOR_URL")
        if self.sink is SinkKind.STORE and not self.dsn:
            raise ConfigError("KVTRACE_SINK=store needs KVTRACE_DSN")
        for extra, modules in self.needs():
            missing = [m for m in modules if not _importable(m)]
            if missing:
                raise ConfigError(f"{self.describe()} needs kvtrace's {extra!r} extra, which this environment "
                                  f"lacks (no module {missing[0]!r}): pip install 'kvtrace[{extra}]'")

    def needs(self) -> list[tuple[str, tuple[str, ...]]]:
        """The extras (and a module each provides) the chosen sink imports: the core alone
        writes spool files and sends rows to a collector."""
        if self.sink is SinkKind.STORE:
            return [("store", ("clickhouse_connect", "pyarrow", "polars"))]
        if self.sink is SinkKind.OTLP:
            return [("otlp", ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"))]
        if self.sink is SinkKind.COLLECTOR and self.collector_wire is Wire.COLUMNS:
            return [("arrow", ("pyarrow",))]
        return []

    def describe(self) -> str:
        """The setting that chose the sink, as the user wrote it."""
        if self.sink is SinkKind.COLLECTOR and self.collector_wire is Wire.COLUMNS:
            return "KVTRACE_COLLECTOR_WIRE=columns"
        return f"KVTRACE_SINK={self.sink.value}"


def _importable(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a dotted name's parents are)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def build_sink(settings: EmitterSettings) -> Sink:
    """The sink the settings name; imports only what that sink needs."""
    if settings.sink is SinkKind.COLLECTOR:
        from kvtrace.instrumentation.sinks.http import HttpSink

        return HttpSink(settings.collector_url, token=settings.token, wire=settings.collector_wire)
    if settings.sink is SinkKind.STORE:
        from kvtrace.instrumentation.sinks.store import StoreSink

        return StoreSink.open(settings.dsn)
    if settings.sink is SinkKind.OTLP:
        from kvtrace.instrumentation.sinks.otlp import OtlpLogSink

        return OtlpLogSink(endpoint=settings.otlp_endpoint)
    from kvtrace.instrumentation.sinks.spool import SpoolSink

    return SpoolSink(settings.spool_dir or default_spool_dir())


def default_spool_dir() -> str:
    from kvtrace.schema.paths import data_dir

    return str(data_dir() / "spool")


SHIPPER_MODULE = "kvtrace.instrumentation.shipper"


def start_shipper(journal: Path, env: Mapping[str, str] | None = None) -> None:
    """Start the process that ships `journal` if this one dies first (`kvtrace.instrumentation.
    shipper`), detached: the first process forks the shipper and exits, and only it is waited
    for. `env`: the sink settings, on top of this process's environment."""
    environment = dict(os.environ)
    environment.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", SHIPPER_MODULE, str(journal)],
        env=environment,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    code = proc.wait(timeout=60)
    if code != 0:
        raise RuntimeError(f"the shipper's first process exited with status {code}")


def configure(settings: EmitterSettings | None = None, engine: str = "") -> Emitter:
    """Install the process-wide emitter the settings describe (the no-op when disabled)."""
    settings = settings or EmitterSettings.from_env()
    if not settings.enabled:
        set_emitter(None).shutdown()  # as below: the emitter replaced is flushed and closed
        from kvtrace.instrumentation.api import get_emitter

        return get_emitter()
    emitter = BatchEmitter(build_sink(settings), settings.batch, instance=settings.instance, engine=engine,
                           journal=settings.journal_config())
    previous = set_emitter(emitter)
    previous.shutdown()
    return emitter


def enabled_settings(log: logging.Logger) -> EmitterSettings | None:
    """An engine plugin's start: the settings when tracing is on, None when it is off or a
    setting is wrong (named loudly at start-up; tracing then stays off)."""
    try:
        settings = EmitterSettings.from_env()
    except ConfigError as exc:
        log.error("kvtrace: %s; tracing is off", exc)
        return None
    return settings if settings.enabled else None


def engine_instance(settings: EmitterSettings | None = None) -> str:
    """The instance name every kvtrace hook in this process stamps: KVTRACE_INSTANCE, else host:pid."""
    settings = settings or EmitterSettings.from_env()
    return settings.instance or f"{socket.gethostname()}:{os.getpid()}"
