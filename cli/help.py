"""What every `kvtrace` command's parser shares, applied in one place after the groups register
theirs: the global options (accepted before or after the subcommand), a description line and an
example in each `--help`, and each option's default shown beside its help.

Done centrally so a command group only says what is its own; a new subcommand without an
example here is caught by the help test, not by a user. Standard library only (see `main`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from kvtrace.schema.paths import data_dir
from kvtrace.store.dsn import StoreError, parse_dsn

# One or two examples per command path ("db init"); the first line of each is a command line,
# an optional second part after "  # " says what it does.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "demo": ("kvtrace demo --requests 100   # a smaller run of the bundled trace",),
    "replay": ("kvtrace replay trace.jsonl --recipe mamba-hybrid --limit 500",
               "kvtrace replay trace.jsonl --engine vllm --vllm-layout full+sliding"),
    "verify": ("kvtrace verify Qwen/Qwen3-0.6B --trace trace.jsonl --limit 50",),
    "experiment": ("kvtrace experiment trace.jsonl --limit 300 --policies lru,interval:512,branch",),
    "db": ("kvtrace db init && kvtrace db status",),
    "db init": ("kvtrace db init --ttl-days 30",),
    "db status": ("kvtrace db status --dsn http://user:pass@clickhouse:8123/kvtrace",),
    "db ddl": ("kvtrace db ddl --cluster c1 --database kvtrace > schema.sql",),
    "ingest": ("kvtrace ingest events.jsonl spool/*.spool",),
    "export": ("kvtrace export -o events.parquet --since 2026-01-01T00:00:00 --model llama",),
    "schema": ("kvtrace schema --format ddl",),
    "analyze": ("kvtrace analyze --by model,instance",
                "kvtrace analyze --since 2026-12-02T09:00 --until 2026-12-02T10:00   # one hour, from a snapshot",
                "kvtrace analyze --recipe llama=dense --path duckdb events.parquet"),
    "costs": ("kvtrace costs --recipe dense --starts 0,4096,32768",),
    "capacity": ("kvtrace capacity --recipe dense --requests 0.95",),
    "report": ("kvtrace report --recipe dense -o report.html",),
    "calibrate": ("kvtrace calibrate --model llama --device cuda:0",),
    "collector": ("kvtrace collector --port 4318 --tokens-file tokens.txt",),
    "dashboard": ("kvtrace dashboard --port 8050   # then open http://127.0.0.1:8050/",),
    "grafana": ("kvtrace grafana -o grafana/",),
    "alerts": ("kvtrace alerts --once",),
    "serve": ("kvtrace serve   # ingest on :4318, the dashboard at http://127.0.0.1:4318/dashboard/",),
}

# Help for options several commands spell alike, where a command left it out.
COMMON_HELP = {
    "--host": "address to listen on",
    "--port": "port to listen on",
}


def has_default(action: argparse.Action) -> bool:
    """Whether an option has a default worth showing: not a switch's, nor none, nor an empty
    value or list."""
    default = action.default
    return not (default is None or isinstance(default, bool) or default == argparse.SUPPRESS
                or (isinstance(default, (str, list, tuple)) and not default))


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description and examples as written, and shows each option's default unless
    its help already says it (a switch, an empty value or a list has none worth showing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or not has_default(action) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def dsn(text: str) -> str:
    """`--dsn`, checked when parsed: a DSN that cannot name a store is a usage error."""
    try:
        parse_dsn(text)
    except StoreError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_global_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """`--dsn` on the top parser and on every subcommand. A subcommand's copy defaults to
    SUPPRESS, so it sets the value only when given there and never undoes one given before."""
    parser.add_argument("--dsn", type=dsn, default=None if top else argparse.SUPPRESS,
                        help="store address: chdb:///PATH (embedded) or http(s)://user:pass@host:8123/db "
                             f"(default: $KVTRACE_DSN, else chdb://{data_dir() / 'chdb'})")


def commands(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """Every subcommand as (path, parser, its one-line help), parents before their children."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                full = f"{path} {name}".strip()
                yield full, sub, helps.get(name, "")
                yield from commands(sub, full)


def finish(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Apply the shared conventions to every subcommand the groups registered."""
    parser.formatter_class = Formatter
    for path, sub, line in commands(parser):
        sub.formatter_class = Formatter
        if not sub.description and line:
            sub.description = line[0].upper() + line[1:] + "."
        examples = EXAMPLES.get(path, ())
        if examples and not sub.epilog:
            sub.epilog = "example:\n" + "\n".join(f"  {e}" for e in examples)
        for action in sub._actions:
            if action.help is None:
                action.help = next((COMMON_HELP[o] for o in action.option_strings if o in COMMON_HELP), None)
        add_global_options(sub, top=False)
    return parser
