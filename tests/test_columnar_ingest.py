"""The columnar wire format (an Arrow IPC stream of events): reading it, checking its rows
column-wise, and the collector's intake of it."""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import EDGES, events, seeded_events

from kvtrace.collector.auth import OPEN, TokenTable
from kvtrace.collector.intake import IntakeError, intake_batch
from kvtrace.schema.arrow import arrow_schema, from_arrow, to_arrow
from kvtrace.schema.arrow_checks import clean_rows
from kvtrace.schema.arrow_wire import ARROW_TYPE, ENVELOPE_KEY, MAX_ROWS, Envelope, encode_columns
from kvtrace.schema.events import SCHEMA_VERSION, Event
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.validation import clean
from kvtrace.schema.wire import CONTENT_TYPE


def _arrowable(event: Event) -> bool:
    try:
        to_arrow([event])
    except (OverflowError, pa.ArrowException):
        return False  # a value no Arrow column of its type can hold never reaches clean_rows
    return True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(events(), st.dictionaries(st.sampled_from(sorted(EDGES)), st.none(), max_size=4)),
                min_size=1, max_size=12), st.data())
def test_clean_rows_agrees_with_clean(drawn: list, data: st.DataObject) -> None:
    """Column-wise, the same verdict as the row fast path gives each event (plus: only this
    schema version's rows are clean; older ones take the row path that upgrades them)."""
    batch = [msgspec.structs.replace(e, **{n: data.draw(EDGES[n], label=n) for n in edits}) for e, edits in drawn]
    batch = [e for e in batch if _arrowable(e)]
    expected = [e.schema_version == SCHEMA_VERSION and clean(e) for e in batch]
    assert clean_rows(to_arrow(batch)).tolist() == expected


# -- intake ------------------------------------------------------------------------------------
ENVELOPE = Envelope(source_id=7, batch_seq=3, sent_ns=1)


def lookup(seq: int, tenant: str = "", **kw: object) -> Event:
    return Event(kind=EventKind.LOOKUP, ts_ns=1_750_000_000_000_000_000 + seq, source_id=7, seq=seq,
                 instance="i1", model="m", request_id=f"r{seq}", prompt_tokens=32, tenant=tenant, **kw)


def stream(table: pa.Table, envelope: bytes | None = b'{"wire_version":1,"source_id":7,"batch_seq":3,"sent_ns":1}',
           **options: object) -> bytes:
    if envelope is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), ENVELOPE_KEY: envelope})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_columns_round_trip_through_intake_unchanged() -> None:
    events = seeded_events(300, seed=4)
    stats = EmitterStats(ts_ns=5, source_id=7, emitted=300)
    body = encode_columns(msgspec.structs.replace(ENVELOPE, stats=stats), events)
    intake = intake_batch(body, ARROW_TYPE, OPEN)
    assert (intake.received, intake.accepted, intake.quarantined) == (300, 300, 0)
    assert intake.batch.stats == stats and intake.batch.events == []
    assert from_arrow(intake.table) == events


def test_bad_column_rows_are_quarantined_with_the_row_paths_reasons() -> None:
    """Each bad row is named as the row formats name it; the good rows stay columns."""
    rows = [msgspec.to_builtins(lookup(i)) for i in range(6)]
    rows[1]["reported_hit_tokens"] = 99  # past its prompt
    rows[2]["kind"] = "teleport"  # not a kind
    rows[3]["ts_ns"] = None  # a null
    rows[4]["schema_version"] = SCHEMA_VERSION + 1
    table = pa.Table.from_pylist(rows, schema=pa.schema([f.with_nullable(True) for f in arrow_schema()]))
    for name in ("more_keys", "group_block_keys", "group_hit_tokens", "reused_tiers", "reused_tokens"):
        assert name in table.column_names
    intake = intake_batch(stream(table), ARROW_TYPE, OPEN)
    assert (intake.received, intake.accepted, intake.quarantined) == (6, 2, 4)
    by_row = {r.row: r for r in intake.batch.rejections}
    assert sorted(by_row) == [2, 3, 4, 5]
    assert by_row[2].field == "reported_hit_tokens" and "exceeds prompt_tokens" in by_row[2].reason
    assert by_row[3].field == "kind" and by_row[4].field == "ts_ns" and by_row[5].field == "schema_version"
    assert all(r.origin.endswith(":0000000000000007:3") and r.raw for r in by_row.values())
    assert [e.seq for e in from_arrow(intake.table)] == [0, 5]

    # The same rows as msgpack: the same verdicts, row for row.
    body = msgspec.msgpack.encode({"wire_version": 1, "source_id": 7, "batch_seq": 3, "sent_ns": 1,
                                   "events": [{k: v for k, v in r.items() if v is not None} for r in rows]})
    same = intake_batch(body, CONTENT_TYPE, OPEN)
    assert [(r.row, r.field) for r in same.batch.rejections] == [(r.row, r.field) for r in intake.batch.rejections]


def test_nulls_and_strangers_inside_list_columns_flag_only_their_row() -> None:
    table = to_arrow([lookup(i) for i in range(3)])
    tiers = pa.array([[], ["device", "nowhere"], []], pa.list_(pa.string()))
    keys = pa.array([[[1, None]], [], []], pa.list_(pa.list_(pa.uint64())))
    table = table.set_column(table.schema.get_field_index("reused_tiers"), "reused_tiers", tiers)
    table = table.set_column(table.schema.get_field_index("group_block_keys"), "group_block_keys", keys)
    assert clean_rows(table).tolist() == [False, False, True]
    intake = intake_batch(stream(table), ARROW_TYPE, OPEN)
    assert sorted(r.row for r in intake.batch.rejections) == [1, 2] and intake.accepted == 1


def test_other_widths_of_the_same_values_are_read_and_missing_columns_take_defaults() -> None:
    events = [lookup(i) for i in range(4)]
    full = to_arrow(events)
    keep = ["kind", "ts_ns", "source_id", "seq", "request_id", "prompt_tokens", "instance", "model"]
    table = full.select(keep)
    table = table.set_column(keep.index("prompt_tokens"), "prompt_tokens",
                             table.column("prompt_tokens").cast(pa.int64()))
    table = table.set_column(keep.index("kind"), "kind", table.column("kind").cast(pa.large_string()))
    table = table.append_column("from_a_newer_writer", pa.array([1, 2, 3, 4]).dictionary_encode())
    intake = intake_batch(stream(table), ARROW_TYPE, OPEN)
    assert intake.accepted == 4 and from_arrow(intake.table) == events
    # several record batches (a chunked table) read like one
    batches = to_arrow(events).to_batches(max_chunksize=1)
    intake = intake_batch(stream(pa.Table.from_batches(batches)), ARROW_TYPE, OPEN)
    assert intake.accepted == 4 and from_arrow(intake.table) == events


def test_columns_whose_type_means_something_else_are_refused_by_name() -> None:
    """Arrow would cast these; the row formats would refuse each row. Encodings that share data
    between rows are refused too: they would let a small request decode into a huge table."""
    table = to_arrow([lookup(0)])
    n = table.num_rows

    def with_column(name: str, values: pa.Array) -> bytes:
        return stream(table.set_column(table.schema.get_field_index(name), name, values))

    cases = {
        "ts_ns": pa.array([1_750_000_000_000_000], pa.timestamp("us")),
        "seq": pa.array([True]),
        "prompt_tokens": pa.array([32.0]),
        "in_flight": pa.array([1], pa.int8()),
        "tenant": pa.array([1]),
        "model": pa.array(["m"]).dictionary_encode(),
        "request_id": pa.array(["r0"], pa.string_view()),
        "instance": pa.nulls(n),
        "group_hit_tokens": pa.array([["1"]], pa.list_(pa.string())),
    }
    for name, values in cases.items():
        with pytest.raises(IntakeError) as err:
            intake_batch(with_column(name, values), ARROW_TYPE, OPEN)
        assert err.value.status == 400 and f"column {name!r} is {values.type}" in err.value.message, err.value.message


def test_a_batch_of_too_many_rows_is_refused_before_it_is_read_out() -> None:
    n = MAX_ROWS + 1
    table = pa.table({"kind": pa.array(["lookup"] * n), "ts_ns": pa.array([1] * n, pa.int8()),
                      "source_id": pa.array([1] * n, pa.int8()), "seq": pa.array([1] * n, pa.int8())})
    with pytest.raises(IntakeError) as err:
        intake_batch(stream(table), ARROW_TYPE, OPEN)
    assert err.value.status == 413 and f"the limit is {MAX_ROWS}" in err.value.message


def test_whole_columnar_request_faults_name_their_cause() -> None:
    table = to_arrow([lookup(0)])
    too_big = table.set_column(table.schema.get_field_index("prompt_tokens"), "prompt_tokens",
                               pa.array([2**40], pa.int64()))
    cases = [
        (b"\xff\xff\xff\xffgarbage", "not a readable Arrow IPC stream"),
        (stream(table, envelope=None), "no 'kvtrace.batch' envelope"),
        (stream(table, envelope=b"{"), "envelope"),
        (stream(table, envelope=b'{"wire_version":2,"source_id":7,"batch_seq":3,"sent_ns":1}'), "wire version 2"),
        (stream(table, envelope=b'{"wire_version":1,"source_id":-7,"batch_seq":3,"sent_ns":1}'), "source_id"),
        (stream(table.drop_columns(["seq"])), "column 'seq' is missing"),
        (stream(table.append_column("seq", table.column("seq"))), "column 'seq' appears more than once"),
        (stream(too_big), "column 'prompt_tokens' does not fit"),
        (stream(table, compression="zstd"), "compressed inside Arrow IPC"),
        (stream(table, compression="lz4"), "compressed inside Arrow IPC"),
        (stream(table)[:-40], "not a readable Arrow IPC stream"),
    ]
    for body, text in cases:
        with pytest.raises(IntakeError) as err:
            intake_batch(body, ARROW_TYPE, OPEN)
        assert err.value.status == 400 and text in err.value.message, (text, err.value.message)


def test_dictionary_batches_compressed_are_refused_too() -> None:
    table = pa.table({"kind": pa.array(["lookup"]).dictionary_encode()})
    with pytest.raises(IntakeError) as err:
        intake_batch(stream(table, compression="zstd"), ARROW_TYPE, OPEN)
    assert "compressed" in err.value.message


def test_columns_land_in_the_tokens_namespace() -> None:
    grant = TokenTable.parse_env("t=acme,zeta").check("t")
    assert grant is not None
    body = encode_columns(ENVELOPE, [lookup(0), lookup(1, tenant="zeta")])
    intake = intake_batch(body, ARROW_TYPE, grant)
    # a token of several tenants is an engine's: its rows without a tenant are its own, for all of them
    assert intake.table.column("tenant").to_pylist() == ["", "zeta"]
    body = encode_columns(ENVELOPE, [lookup(0), lookup(1, tenant="beta", reported_hit_tokens=64),
                                     lookup(2, tenant="beta")])
    with pytest.raises(IntakeError) as err:  # row 2 is bad anyway; row 3 is the accepted one that reaches out
        intake_batch(body, ARROW_TYPE, grant)
    assert err.value.status == 403 and "row 3" in err.value.message and "'beta'" in err.value.message
    body = encode_columns(ENVELOPE, [lookup(0), lookup(1, tenant="beta", reported_hit_tokens=64)])
    intake = intake_batch(body, ARROW_TYPE, grant)  # a foreign tenant only on a quarantined row
    assert intake.accepted == 1 and intake.quarantined == 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_damaged_streams_are_refused_or_read_never_crash(data: st.DataObject) -> None:
    """Bytes flipped, cut or inserted anywhere in a real stream: a 400 naming the fault, or rows
    that were checked like any others; never another exception (or a crash of the process)."""
    body = bytearray(encode_columns(ENVELOPE, seeded_events(20, seed=data.draw(st.integers(0, 5)))))
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, len(body) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            body[at] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del body[at:at + data.draw(st.integers(1, 64))]
        else:
            body[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    try:
        intake = intake_batch(bytes(body), ARROW_TYPE, OPEN)
    except IntakeError as exc:
        assert exc.status == 400 and exc.message
    else:
        assert intake.accepted + intake.quarantined == intake.received
