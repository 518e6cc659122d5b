-- Version 3: a clean shutdown saves the in-memory occurrence counters, so the
-- next start can restore them and keep every lease (agents ride out the
-- restart); after a crash there is no marker and the kernel retires the leases.
CREATE TABLE saved_counters (
    execution_id  TEXT NOT NULL,
    kind          TEXT NOT NULL,
    target        TEXT NOT NULL,
    args_hash     TEXT NOT NULL,
    value         INTEGER NOT NULL,
    PRIMARY KEY (execution_id, kind, target, args_hash)
) WITHOUT ROWID;
CREATE TABLE clean_shutdown (
    id  INTEGER PRIMARY KEY CHECK (id = 1),
    at  REAL NOT NULL
);
