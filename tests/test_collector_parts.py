"""The collector's parts without HTTP: tokens, the durable spool, request intake."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import msgspec
import pyarrow as pa
import pytest

from kvtrace.collector.auth import OPEN, AuthConfigError, TokenTable
from kvtrace.collector.intake import JSON_TYPE, IntakeError, decompress, intake_batch, intake_otlp
from kvtrace.collector.spool import DurableSpool, SpoolFull, joined_columns, spool_columns
from kvtrace.schema.arrow import arrow_schema, from_arrow, to_arrow
from kvtrace.schema.arrow_wire import ARROW_TYPE, Envelope, encode_columns, write_stream
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind, Reason, Tier
from kvtrace.schema.wire import CONTENT_TYPE, Batch, encode_batch
from kvtrace.store.client import Store


def lookup(seq: int, tenant: str = "", **kw: object) -> Event:
    return Event(kind=EventKind.LOOKUP, ts_ns=1_750_000_000_000_000_000 + seq, source_id=7, seq=seq,
                 instance="i1", model="m", request_id=f"r{seq}", prompt_tokens=32, tenant=tenant, **kw)


# -- tokens ------------------------------------------------------------------------------------
def test_tokens_from_a_file_grant_their_tenants_and_nothing_else(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text("# comment\ns3cret-a acme\ns3cret-b acme, beta  # two tenants\nroot-tok *\n")
    table = TokenTable.parse_file(f)
    a, b, op = table.check("s3cret-a"), table.check("s3cret-b"), table.check("root-tok")
    assert a and a.allows("acme") and not a.allows("beta") and a.home == "acme"
    assert b and b.tenants == {"acme", "beta"}
    assert op and op.operator and op.allows("anyone")
    assert table.check("s3cret") is None and table.check("") is None
    assert table.from_header("Bearer s3cret-a") == a
    assert table.from_header("bearer  s3cret-a ") == a
    assert table.from_header("Basic s3cret-a") is None and table.from_header(None) is None


def test_bad_token_config_names_the_line_and_never_the_token(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text("tok-1 acme\nhidden-token-value\n")
    with pytest.raises(AuthConfigError) as err:
        TokenTable.parse_file(f)
    assert f"{f}:2" in str(err.value) and "hidden-token-value" not in str(err.value)
    with pytest.raises(AuthConfigError, match="entry 2"):
        TokenTable.parse_env("a=acme;no-equals-sign")
    with pytest.raises(AuthConfigError, match="twice"):
        TokenTable.parse_env("a=acme;a=beta")


def test_no_tokens_means_open_and_env_combines_file_and_inline(tmp_path: Path) -> None:
    assert TokenTable.from_env({}).from_header(None) is OPEN
    f = tmp_path / "tokens"
    f.write_text("t1 acme\n")
    table = TokenTable.from_env({"KVTRACE_COLLECTOR_TOKENS_FILE": str(f), "KVTRACE_COLLECTOR_TOKENS": "t2=beta"})
    assert len(table) == 2 and table.check("t2").home == "beta" and table.from_header(None) is None


# -- spool -------------------------------------------------------------------------------------
def test_spool_drains_in_order_and_survives_restart(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path, segment_bytes=300)
    payloads = [f"batch-{i}".encode() * 10 for i in range(12)]
    for p in payloads:
        spool.append(p)
    assert spool.pending_segments > 1  # rolled over
    first = spool.read(max_bytes=250)
    assert first is not None and first.payloads == payloads[: len(first.payloads)]
    spool.done(first)
    spool.close()

    again = DurableSpool(tmp_path, segment_bytes=300)  # a restart: resume after the checkpoint
    seen = list(first.payloads)
    while (chunk := again.read()) is not None:
        seen += chunk.payloads
        again.done(chunk)
    assert seen == payloads and again.pending_bytes == 0
    assert len(list(tmp_path.glob("seg-*"))) == 1  # drained segments are deleted (the active one stays)


def test_unfinished_insert_is_retried_with_the_same_range_and_token(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path)
    for i in range(5):
        spool.append(b"x%d" % i)
    chunk = spool.read(max_frames=3)
    assert chunk is not None
    for i in range(5, 8):  # more arrives while the insert runs; then the collector is killed
        spool.append(b"x%d" % i)
    spool.close()

    again = DurableSpool(tmp_path)
    redo = again.read()
    assert redo is not None and (redo.payloads, redo.token) == (chunk.payloads, chunk.token)
    again.done(redo)
    rest = again.read()
    assert rest is not None and rest.payloads == [b"x%d" % i for i in range(3, 8)] and rest.token != chunk.token


def test_torn_tail_is_cut_at_restart_and_appends_continue(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path)
    spool.append(b"kept")
    spool.close()
    seg = next(tmp_path.glob("seg-*"))
    with open(seg, "ab") as f:  # a frame header and half a payload: a crash mid-append
        f.write(b"\x00\x00\x00\x10\x00\x00\x00\x00half")
    again = DurableSpool(tmp_path)
    assert again.torn_bytes == 12
    again.append(b"after")
    chunks = []
    while (c := again.read()) is not None:
        chunks += c.payloads
        again.done(c)
    assert chunks == [b"kept", b"after"]


def test_spooled_columns_pass_to_the_store_as_one_stream(store: Store) -> None:
    """The drain hands the store the records' compressed streams joined, unread: the store
    reads the same events; a stream that cannot pass as it is (another schema's fields, a
    dictionary batch, not a stream) gives None, and the drain reads and conforms it instead."""
    a = to_arrow([lookup(i, tenant="t1") for i in range(5)])
    b = to_arrow([lookup(i, tenant="t2", model_revision="r2") for i in range(5, 12)])
    joined = joined_columns([spool_columns(a), spool_columns(b)], arrow_schema())
    assert joined is not None
    assert pa.ipc.open_stream(joined).read_all().equals(pa.concat_tables([a, b]))
    store.insert_arrow_stream("events", joined, arrow_schema().names)
    back = sorted((e for t in store.iter_event_batches() for e in from_arrow(t)), key=lambda e: e.seq)
    assert back == [lookup(i, tenant="t1") for i in range(5)] + [lookup(i, tenant="t2", model_revision="r2")
                                                                 for i in range(5, 12)]
    older = spool_columns(a.drop_columns(["noise_floor"]))
    coded = a.set_column(a.schema.get_field_index("tenant"), "tenant", a.column("tenant").dictionary_encode())
    for bad in (older, write_stream(coded, compression="lz4"), b"not an Arrow stream"):
        assert joined_columns([spool_columns(a), bad], arrow_schema()) is None


def test_spool_refuses_past_its_bound(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path, max_bytes=100)
    spool.append(b"a" * 50)
    with pytest.raises(SpoolFull, match="bound 100"):
        spool.append(b"b" * 50)
    chunk = spool.read()
    assert chunk is not None
    spool.done(chunk)
    spool.append(b"b" * 50)  # drained: room again


# -- intake ------------------------------------------------------------------------------------
def test_good_rows_are_kept_and_bad_rows_quarantined_with_their_cause() -> None:
    raw = [msgspec.to_builtins(lookup(i)) for i in range(4)]
    raw[1]["prompt_tokens"] = -5
    raw[2]["kind"] = "teleport"
    del raw[3]["ts_ns"]
    body = msgspec.msgpack.encode({"wire_version": 1, "source_id": 7, "batch_seq": 1, "sent_ns": 1, "events": raw})
    intake = intake_batch(body, CONTENT_TYPE, OPEN)
    assert (intake.received, intake.accepted, intake.quarantined) == (4, 1, 3)
    by_row = {r.row: r for r in intake.batch.rejections}
    assert by_row[2].field == "prompt_tokens" and by_row[3].field == "kind" and by_row[4].field == "ts_ns"
    assert all(r.reason and r.received_ns > 0 for r in by_row.values())

    as_json = msgspec.json.encode({"wire_version": 1, "source_id": 7, "batch_seq": 1, "sent_ns": 1, "events": raw})
    same = intake_batch(as_json, JSON_TYPE + "; charset=utf-8", OPEN)
    assert [r.field for r in same.batch.rejections] == [r.field for r in intake.batch.rejections]


def test_whole_request_faults_name_their_cause() -> None:
    good = encode_batch(Batch(source_id=7, batch_seq=1, sent_ns=1, events=[lookup(0)]))
    cases = [
        (b"\xc1garbage", CONTENT_TYPE, 400, "not a kvtrace batch"),
        (msgspec.msgpack.encode({"wire_version": 9, "source_id": 1, "batch_seq": 1, "sent_ns": 1}), CONTENT_TYPE,
         400, "wire version 9"),
        (good, "text/plain", 415, "Content-Type 'text/plain'"),
        (b"{", JSON_TYPE, 400, "not a kvtrace batch"),
    ]
    for body, ctype, status, text in cases:
        with pytest.raises(IntakeError) as err:
            intake_batch(body, ctype, OPEN)
        assert err.value.status == status and text in err.value.message


def test_a_token_writes_only_into_its_own_namespace() -> None:
    grant = TokenTable.parse_env("t=acme").check("t")
    assert grant is not None
    body = encode_batch(Batch(source_id=7, batch_seq=1, sent_ns=1, events=[lookup(0), lookup(1, tenant="acme")]))
    intake = intake_batch(body, CONTENT_TYPE, grant)
    assert [e.tenant for e in intake.batch.events] == ["acme", "acme"]  # unnamed rows land in the home tenant
    body = encode_batch(Batch(source_id=7, batch_seq=1, sent_ns=1, events=[lookup(0), lookup(1, tenant="beta")]))
    with pytest.raises(IntakeError) as err:
        intake_batch(body, CONTENT_TYPE, grant)
    assert err.value.status == 403 and "row 2" in err.value.message and "'beta'" in err.value.message


def test_an_engines_token_of_several_tenants_leaves_the_engines_own_rows_without_one() -> None:
    """An engine serving two tenants sends rows of each (its requests' cache salt) and rows of
    no tenant: its attach and the restart invalidation it implies, evictions, usage. Those are
    facts for every tenant of the engine; placed in the token's first tenant, the restart
    invalidated only that tenant's blocks, and the other's looked recoverable after a restart."""
    grant = TokenTable.parse_env("t=acme,beta").check("t")
    assert grant is not None and grant.home == ""
    restart = Event(kind=EventKind.INVALIDATE, ts_ns=1_750_000_000_000_000_000, source_id=7, seq=9, instance="i1",
                    model="m", tier=Tier.DEVICE, reason=Reason.RESTART)
    rows = [restart, lookup(1, tenant="acme"), lookup(2, tenant="beta")]
    intake = intake_batch(encode_batch(Batch(source_id=7, batch_seq=1, sent_ns=1, events=rows)), CONTENT_TYPE, grant)
    assert [e.tenant for e in intake.batch.events] == ["", "acme", "beta"]
    columns = encode_columns(Envelope(source_id=7, batch_seq=2, sent_ns=1), rows)
    assert intake_batch(columns, ARROW_TYPE, grant).table.column("tenant").to_pylist() == ["", "acme", "beta"]
    # a token of one tenant still places them in it, on both paths
    one = TokenTable.parse_env("t=acme").check("t")
    assert one is not None and one.home == "acme"
    mine = encode_columns(Envelope(source_id=7, batch_seq=3, sent_ns=1), rows[:2])
    assert intake_batch(mine, ARROW_TYPE, one).table.column("tenant").to_pylist() == ["acme", "acme"]

def test_decompression_is_bounded() -> None:
    bomb = gzip.compress(b"\x00" * (10 << 20))
    with pytest.raises(IntakeError) as err:
        decompress(bomb, "gzip", 1 << 20)
    assert err.value.status == 413
    with pytest.raises(IntakeError) as err:
        decompress(bomb[:-20], "gzip", 64 << 20)
    assert err.value.status == 400 and "truncated" in err.value.message
    with pytest.raises(IntakeError) as err:
        decompress(b"x", "br", 100)
    assert err.value.status == 415
    assert decompress(gzip.compress(b"hello"), "gzip", 100) == b"hello"


def test_zstd_decompression_is_bounded_too() -> None:
    bomb = pa.compress(b"\x00" * (64 << 20), "zstd", asbytes=True)  # ~2 KB that would inflate to 64 MiB
    with pytest.raises(IntakeError) as err:
        decompress(bomb, "zstd", 1 << 20)
    assert err.value.status == 413
    for broken in (bomb[:-8], b"not zstd at all"):
        with pytest.raises(IntakeError) as err:
            decompress(broken, "zstd", 64 << 20)
        assert err.value.status == 400 and "not valid zstd" in err.value.message
    assert decompress(pa.compress(b"hello", "zstd", asbytes=True), "ZSTD", 100) == b"hello"


def _stated_size(frame: bytes, size: int) -> bytes:
    """The frame with its header's content size replaced (a 2-byte field, stored less 256)."""
    descriptor = frame[4]
    assert descriptor >> 6 == 1 and not descriptor & 3  # the layout pyarrow writes for these sizes
    at = 5 if descriptor & 0x20 else 6  # a single-segment frame has no window byte
    return frame[:at] + (size - 256).to_bytes(2, "little") + frame[at + 2:]


def test_zstd_read_in_one_call_where_the_frame_states_its_size_and_as_a_stream_otherwise() -> None:
    """A frame stating its size is inflated in one call (a third of the stream's CPU); what that
    cannot read (frames after the first, a stated size that lies) goes through the stream,
    which reads it whole or names the fault, within the limit as before."""
    one, two = b"abc" * 1000, b"xyz" * 500
    first = pa.compress(one, "zstd", asbytes=True)
    assert decompress(first, "zstd", 1 << 20) == one
    assert decompress(first + pa.compress(two, "zstd", asbytes=True), "zstd", 1 << 20) == one + two
    for lie in (len(one) - 10, len(one) + 10):
        with pytest.raises(IntakeError) as err:
            decompress(_stated_size(first, lie), "zstd", 1 << 20)
        assert err.value.status == 400 and "not valid zstd" in err.value.message
    # A small first frame, then one that inflates past the limit: the size the first states is
    # within it, the body is not.
    bomb = pa.compress(b"\x00" * (8 << 20), "zstd", asbytes=True)
    with pytest.raises(IntakeError) as err:
        decompress(first + bomb, "zstd", 1 << 20)
    assert err.value.status == 413


def test_otlp_logs_carry_events_in_protobuf_and_json() -> None:
    from google.protobuf import json_format
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    req = ExportLogsServiceRequest()
    records = req.resource_logs.add().scope_logs.add().log_records
    for i in range(3):
        r = records.add()
        r.event_name = "kvtrace.event"
        r.body.string_value = msgspec.json.encode(lookup(i)).decode()
    records[1].body.string_value = '{"kind": "lookup"}'  # missing the wire-required fields
    other = records.add()
    other.body.string_value = "an application log line"
    for payload, ctype in ((req.SerializeToString(), "application/x-protobuf"),
                           (json_format.MessageToJson(req).encode(), "application/json")):
        intake, foreign = intake_otlp(payload, ctype, OPEN)
        assert (intake.accepted, intake.quarantined, foreign) == (2, 1, 1)
        assert intake.batch.rejections[0].row == 2 and intake.batch.rejections[0].field
    with pytest.raises(IntakeError) as err:
        intake_otlp(b"\xff\xff\xff", "application/x-protobuf", OPEN)
    assert err.value.status == 400



def test_otlp_json_that_is_not_the_records_path_is_refused_by_name() -> None:
    """protobuf's JSON parser lets some malformed shapes through as empty; each is named instead."""
    for doc, named in (({"resourceLogs": [None]}, "resourceLogs[0] must be an object"),
                       ({"resource_logs": ["AAA"]}, "resource_logs[0] must be an object"),
                       ({"resourceLogs": {}}, "resourceLogs must be an array"),
                       ({"resourceLogs": [], "resource_logs": []}, "the same field"),
                       ({"resourceLogs": [{"scopeLogs": [{"logRecords": 7}]}]},
                        "resourceLogs[0].scopeLogs[0].logRecords must be an array")):
        with pytest.raises(IntakeError) as err:
            intake_otlp(msgspec.json.encode(doc), "application/json", OPEN)
        assert err.value.status == 400 and named in err.value.message, doc
    for empty in ({"resource_logs": None}, {"resourceLogs": [{"scopeLogs": None}]}, {"other": [None]}):
        intake, foreign = intake_otlp(msgspec.json.encode(empty), "application/json", OPEN)
        assert (intake.accepted, intake.quarantined, foreign) == (0, 0, 0), empty

def test_spool_directory_keeps_its_id(tmp_path: Path) -> None:
    a = DurableSpool(tmp_path).spool_id
    assert DurableSpool(tmp_path).spool_id == a and len(a) == 16  # tokens stay meaningful across restarts
    assert DurableSpool(tmp_path / "other").spool_id != a  # and never collide with another collector's


def test_rows_are_counted_before_they_are_decoded() -> None:
    from kvtrace.collector.bounds import json_rows_over, msgpack_array_length, protobuf_records_over

    # JSON: commas and brackets inside strings and nested lists are not rows
    rows = [{"request_id": "a,b,[c]{d}\\\",", "group_block_keys": [[1, 2], [3]]}] * 40
    raw = msgspec.json.encode(rows)
    assert json_rows_over(raw, cap=1000) == 0 and json_rows_over(raw, cap=39) == 40
    assert json_rows_over(b"[]", cap=0) == 0 and json_rows_over(b"[{},{}]", cap=1) == 2
    with pytest.raises(ValueError, match="nest deeper"):
        json_rows_over(b"[" + b"[" * 20 + b"1,2" + b"]" * 20 + b"]", cap=0)
    for n in (0, 15, 16, 65535, 65536):
        assert msgpack_array_length(msgspec.msgpack.encode([0] * n)) == n
    assert msgpack_array_length(msgspec.msgpack.encode({"a": 1})) == -1
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    req = ExportLogsServiceRequest()
    for _ in range(3):
        scope = req.resource_logs.add().scope_logs.add()
        for _ in range(4):
            scope.log_records.add().body.string_value = "x"
    body = req.SerializeToString()
    assert protobuf_records_over(body, cap=12) == 0 and protobuf_records_over(body, cap=11) == 12
    assert protobuf_records_over(b"\xff\xff", cap=0) == 0  # malformed: left for protobuf to name


def test_a_time_window_quarantines_rows_it_would_not_believe_in_every_format() -> None:
    from kvtrace.collector.intake import TimeWindow

    now = time.time_ns()
    rows = [lookup(i) for i in range(4)]
    rows = [msgspec.structs.replace(e, ts_ns=t) for e, t in
            zip(rows, (now, now - 40 * 86400 * 10**9, now + 3600 * 10**9, now - 1), strict=True)]
    window = TimeWindow()
    for body, ctype in ((encode_batch(Batch(source_id=7, batch_seq=1, sent_ns=1, events=rows)), CONTENT_TYPE),
                        (encode_columns(Envelope(source_id=7, batch_seq=1, sent_ns=1), rows), ARROW_TYPE)):
        intake = intake_batch(body, ctype, OPEN, window)
        assert (intake.accepted, intake.quarantined) == (2, 2)
        assert [(r.row, r.field) for r in intake.batch.rejections] == [(2, "ts_ns"), (3, "ts_ns")]
        assert "more than 30 days before" in intake.batch.rejections[0].reason
        assert "--max-event-age-days" in intake.batch.rejections[0].reason  # the flag as the CLI spells it
        assert "--max-clock-ahead-s" in intake.batch.rejections[1].reason
        assert "after the collector received it" in intake.batch.rejections[1].reason
    assert intake_batch(encode_batch(Batch(source_id=7, batch_seq=1, sent_ns=1, events=rows)), CONTENT_TYPE,
                        OPEN).accepted == 4  # no window: any time
