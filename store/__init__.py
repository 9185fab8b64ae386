"""The store: kvtrace's ClickHouse tables behind one DSN, and the ways in and out of them.

`dsn` names a store without touching ClickHouse; `client` opens it, creates and migrates its
tables and reads and writes them; `ingest` loads event files (JSONL, Parquet, spool) with
quarantine; `export` writes events back out. Nothing here knows an engine, the collector or
the analysis: they all stand on this floor. Import the submodules themselves: this package
imports nothing, so naming a store (`dsn`) never loads the ClickHouse driver.
"""
