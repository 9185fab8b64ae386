"""Every `kvtrace` command's --help follows one convention: a description line, an example,
each option's help with its default, and the global options accepted before or after it."""

from __future__ import annotations

import argparse

import pytest

from kvtrace.cli.help import commands
from kvtrace.cli.main import build_parser, main


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


def _meaningful(default: object) -> bool:
    return not (default is None or isinstance(default, bool) or default == argparse.SUPPRESS
                or (isinstance(default, (str, list, tuple)) and not default))


def test_every_subcommand_help_has_a_description_an_example_and_defaults():
    parser = build_parser()
    walked = []
    for path, sub, _ in commands(parser):
        walked.append(path)
        text = sub.format_help()
        assert sub.description and sub.description in text, path
        assert "\nexample:\n" in text, path
        examples = text.split("\nexample:\n", 1)[1].strip().splitlines()
        assert examples and all(e.strip().startswith(f"kvtrace {path.split()[0]}") for e in examples), (path, examples)
        formatter = sub._get_formatter()
        for action in _options(sub):
            shown = formatter._expand_help(action)
            assert action.help, (path, action.option_strings)
            if _meaningful(action.default):
                assert "default" in shown, (path, action.option_strings, shown)
        assert any("--dsn" in a.option_strings for a in sub._actions), path
    for expected in ("db init", "db status", "analyze", "collector", "dashboard", "alerts", "serve"):
        assert expected in walked


@pytest.mark.parametrize("argv", [["--dsn", "chdb:///x", "analyze"], ["analyze", "--dsn", "chdb:///x"],
                                  ["db", "--dsn", "chdb:///x", "status"], ["db", "status", "--dsn", "chdb:///x"]])
def test_global_options_go_before_or_after_the_command(argv):
    assert build_parser().parse_args(argv).dsn == "chdb:///x"


def test_an_option_after_the_command_wins_and_none_leaves_the_default():
    assert build_parser().parse_args(["--dsn", "chdb:///a", "db", "status", "--dsn", "chdb:///b"]).dsn == "chdb:///b"
    assert build_parser().parse_args(["db", "status"]).dsn is None


def test_a_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["analyze", "--no-such-option"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_sizes_are_given_in_gib():
    args = build_parser().parse_args(["collector", "--max-spool-gib", "0.5"])
    assert args.max_spool_bytes == 1 << 29
    assert build_parser().parse_args(["collector", "--max-spool-mib", "3"]).max_spool_bytes == 3 << 20  # still read
    assert build_parser().parse_args(["collector"]).max_spool_bytes == 1 << 30
    args = build_parser().parse_args(["replay", "t.jsonl", "--lmcache-cpu-gib", "0.25"])
    assert args.lmcache_cpu_gb == 0.25
