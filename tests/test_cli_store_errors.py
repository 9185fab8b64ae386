"""A store that cannot be opened is one `error:` line naming the cause and the way out, from a
real `kvtrace` process: an embedded store another process holds, a server nobody answers at."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from collector_proc import free_port

from kvtrace.store.dsn import parse_dsn
from kvtrace.store.owner import OWNER_FILE, Owner, in_use_message, owning, read_owner


def kvtrace(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtrace.cli.main", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_store_a_dashboard_holds_is_named_in_one_line(tmp_path: Path) -> None:
    dsn = f"chdb://{tmp_path / 'db'}"
    assert kvtrace("db", "init", "--dsn", dsn).returncode == 0
    port = free_port()
    log = open(tmp_path / "dashboard.log", "wb")  # noqa: SIM115 - closed below
    dash = subprocess.Popen([sys.executable, "-m", "kvtrace.cli.main", "dashboard", "--port", str(port),
                             "--dsn", dsn], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert dash.poll() is None, (tmp_path / "dashboard.log").read_text()
            assert time.monotonic() < deadline, "dashboard did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        out = kvtrace("db", "status", "--dsn", dsn)
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr == (f"error: the embedded store at {tmp_path / 'db'} is in use by another process "
                              f"(pid {dash.pid}, `kvtrace dashboard` on http://127.0.0.1:{port}); stop it, or use "
                              "that process's dashboard/collector, or point --dsn at a ClickHouse server\n")

        # An owner file whose process is gone says nothing: the holder is still named by its pid.
        (tmp_path / "db" / OWNER_FILE).write_text(f'{{"pid": {_dead_pid()}, "command": "kvtrace serve"}}')
        out = kvtrace("analyze", "--dsn", dsn)
        assert out.returncode == 1
        assert out.stderr == (f"error: the embedded store at {tmp_path / 'db'} is in use by another process "
                              f"(pid {dash.pid}); stop it, or point --dsn at a ClickHouse server\n")
    finally:
        dash.send_signal(signal.SIGTERM)
        code = dash.wait(60)
        log.close()
    assert code == 0, (tmp_path / "dashboard.log").read_text()
    assert kvtrace("db", "status", "--dsn", dsn).returncode == 0  # free again


def test_an_unreachable_server_is_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    out = kvtrace("db", "status", "--dsn", f"http://127.0.0.1:{port}")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"error: cannot reach the ClickHouse server at http://default@127.0.0.1:{port}/kvtrace: "
                          "connection refused (is the server running, and on this port?)\n")
    out = kvtrace("analyze", "--dsn", "http://user:secret@no-such-host.invalid:8123/kv")
    assert out.returncode == 1
    assert out.stderr == ("error: cannot reach the ClickHouse server at http://user@no-such-host.invalid:8123/kv: "
                          "the host name does not resolve\n")  # and the password is not in it


def test_the_owner_file_is_this_process_while_it_holds_the_store(tmp_path: Path) -> None:
    dsn = parse_dsn(f"chdb://{tmp_path / 'db'}")
    with owning(dsn, "kvtrace serve", "http://127.0.0.1:4318"):
        owner = read_owner(tmp_path / "db")
        assert owner is not None and owner.pid == os.getpid() and owner.command == "kvtrace serve"
    assert not (tmp_path / "db" / OWNER_FILE).exists()
    (tmp_path / "db" / OWNER_FILE).write_text(f'{{"pid": {_dead_pid()}, "command": "kvtrace serve"}}')
    assert read_owner(tmp_path / "db") is None  # stale: its process is gone
    (tmp_path / "db" / OWNER_FILE).write_text("{not json")
    assert read_owner(tmp_path / "db") is None
    assert "(pid 7, `kvtrace collector` on http://h:1)" in in_use_message(
        "/s", 7, Owner(pid=7, command="kvtrace collector", url="http://h:1"))
    assert "(pid 7)" in in_use_message("/s", 7, Owner(pid=8, command="kvtrace collector"))  # not the holder


def test_a_statement_the_store_refuses_is_one_line(capsys, store_dsn) -> None:  # noqa: ANN001
    from kvtrace.cli.main import main

    code = main(["db", "init", "--cluster", "no-such-cluster", "--dsn", store_dsn])
    out, err = capsys.readouterr()
    assert code == 1 and err == "error: the store refused: Requested cluster 'no-such-cluster' not found\n", err
