"""The `kvtrace` command: the top parser, the command groups' subcommands, errors as exit codes.

Each group module registers its subcommands (`store_commands`, `replay_commands`,
`analysis_commands`, `service_commands`); a handler parses its arguments, calls a library
function and prints. Handlers import what they need when they run, so building the parser (and
`kvtrace --help`) loads no store, DataFrame or web stack and works with kvtrace's core alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvtrace.cli import analysis_commands, replay_commands, serve_commands, service_commands, store_commands
from kvtrace.cli.extras import missing_extra
from kvtrace.cli.help import add_global_options, finish
from kvtrace.store.dsn import StoreError

EPILOG = """\
examples:
  kvtrace demo                          replay a real trace through a hybrid cache, analyze, write a report
  kvtrace db init                       create or migrate the tables (idempotent)
  kvtrace db status                     schema version, row counts, reported drops
  kvtrace ingest events.jsonl spool/*   load JSONL, Parquet or spool files
  kvtrace export -o events.parquet      write events out for DuckDB / polars
  kvtrace replay trace.jsonl --recipe mamba-hybrid   a request trace through the simulator
  kvtrace experiment trace.jsonl --limit 300          retention policies compared on one trace
  kvtrace analyze --recipe mamba-hybrid logical vs recoverable vs adopted, and why they differ
  kvtrace analyze --recipe llama=dense --recipe jamba=mamba-hybrid --path duckdb events.parquet
  kvtrace costs --recipe dense          load vs recompute: fitted costs, crossovers, seconds lost
  kvtrace capacity --recipe dense       hit rate against capacity per group; the capacity 99% need
  kvtrace report --recipe dense -o r.html   the HTML report, from the store or Parquet files
  kvtrace alerts --webhook URL          alert on divergence, unsafe reuse, gaps and drops
  kvtrace dashboard                     the web dashboard (and `kvtrace grafana` for Grafana)
  kvtrace collector --port 4318         the ingest service a fleet's shims point at
  kvtrace serve                         collector, dashboard (/dashboard/) and alerts in one process
  kvtrace schema --format ddl           print the ClickHouse DDL (or json, arrow)

The store is chosen by --dsn, else $KVTRACE_DSN, else an embedded ClickHouse (chDB) under
$KVTRACE_HOME (default ~/.local/share/kvtrace). A server: --dsn http://user:pass@host:8123/kvtrace
Global options (--dsn) go before or after the command. Sizes are in GiB.
Exit status: 0 done, 1 failed (the one-line error says why), 2 usage error, 130 interrupted.
"""

GROUPS = (replay_commands, store_commands, analysis_commands, service_commands, serve_commands)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrace",
        description="KV-cache lifecycle tracing for LLM serving: logical vs recoverable vs adopted prefix hits.",
        epilog=EPILOG,
    )
    add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in GROUPS:
        group.register(sub)
    return finish(parser)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a usage error exits 2 here
    try:
        return args.handler(args)
    except StoreError as exc:  # a runtime failure, named in one line
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        if (line := missing_extra(exc, getattr(args, "extra", ""))) is None:
            raise
        print(f"error: kvtrace {args.command}: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # The driver's own errors (a server that went away mid-command): one line, not a traceback.
        if type(exc).__module__.split(".")[0] not in ("clickhouse_connect", "chdb"):
            raise
        from kvtrace.store.client import driver_failure

        if (line := driver_failure(exc)) is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
