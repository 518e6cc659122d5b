-- rebuno-sansio schema, version 1.
-- Executions carry their current dispatch inline (only the latest dispatch of an
-- execution can hold the lease); `dispatches` remembers every dispatch id ever
-- issued, to tell a superseded lease from an unknown one.

CREATE TABLE executions (
    id                       TEXT PRIMARY KEY,
    agent_id                 TEXT NOT NULL,
    status                   TEXT NOT NULL,
    input                    TEXT NOT NULL,
    output                   TEXT,
    state                    TEXT,
    failure_reason           TEXT NOT NULL DEFAULT '',
    session                  TEXT NOT NULL DEFAULT '',
    parent_execution_id      TEXT,
    idempotency_key          TEXT NOT NULL DEFAULT '',
    created_at               REAL NOT NULL,
    updated_at               REAL NOT NULL,
    last_event_seq           INTEGER NOT NULL DEFAULT 0,
    dispatch_id              TEXT,
    dispatch_status          TEXT,
    dispatch_attempt         INTEGER,
    dispatch_max_attempts    INTEGER,
    dispatch_next_attempt_at REAL,
    dispatch_locked_at       REAL
);
CREATE INDEX executions_due ON executions (dispatch_next_attempt_at)
    WHERE dispatch_status IN ('pending', 'failed');
CREATE INDEX executions_in_flight ON executions (dispatch_locked_at)
    WHERE dispatch_status = 'in_flight';
CREATE INDEX executions_session ON executions (session, status, created_at)
    WHERE session != '';
CREATE INDEX executions_idempotency ON executions (agent_id, idempotency_key)
    WHERE idempotency_key != '';
CREATE INDEX executions_agent ON executions (agent_id, id);

CREATE TABLE steps (
    step_id       TEXT PRIMARY KEY,
    execution_id  TEXT NOT NULL,
    kind          TEXT NOT NULL,
    target        TEXT NOT NULL,
    args_hash     TEXT NOT NULL,
    occurrence    INTEGER NOT NULL,
    status        TEXT NOT NULL,
    idempotency   TEXT NOT NULL,
    args          TEXT NOT NULL,
    result        TEXT,
    error         TEXT,
    started_at    REAL,
    completed_at  REAL,
    approval_id   TEXT,
    rule_id       TEXT NOT NULL DEFAULT ''
);
CREATE INDEX steps_execution ON steps (execution_id, args_hash);

CREATE TABLE events (
    execution_id  TEXT NOT NULL,
    seq           INTEGER NOT NULL,
    type          TEXT NOT NULL,
    payload       TEXT NOT NULL,
    occurred_at   REAL NOT NULL,
    PRIMARY KEY (execution_id, seq)
) WITHOUT ROWID;

CREATE TABLE step_counters (
    execution_id  TEXT NOT NULL,
    kind          TEXT NOT NULL,
    target        TEXT NOT NULL,
    args_hash     TEXT NOT NULL,
    value         INTEGER NOT NULL,
    PRIMARY KEY (execution_id, kind, target, args_hash)
) WITHOUT ROWID;

CREATE TABLE dispatches (
    id            TEXT PRIMARY KEY,
    execution_id  TEXT NOT NULL
) WITHOUT ROWID;

CREATE TABLE approvals (
    id            TEXT PRIMARY KEY,
    execution_id  TEXT NOT NULL,
    step_id       TEXT NOT NULL,
    status        TEXT NOT NULL,
    approvers     TEXT NOT NULL,
    message       TEXT NOT NULL DEFAULT '',
    rule_id       TEXT NOT NULL DEFAULT '',
    decided_by    TEXT NOT NULL DEFAULT '',
    decided_at    REAL,
    rationale     TEXT NOT NULL DEFAULT '',
    created_at    REAL NOT NULL,
    timeout_at    REAL NOT NULL
);
CREATE INDEX approvals_pending ON approvals (timeout_at) WHERE status = 'pending';
CREATE INDEX approvals_execution ON approvals (execution_id);
CREATE INDEX approvals_status ON approvals (status, created_at);

CREATE TABLE agents (
    id             TEXT PRIMARY KEY,
    webhook_url    TEXT NOT NULL,
    secret         TEXT NOT NULL,
    registered_at  REAL NOT NULL,
    description    TEXT,
    input_schema   TEXT,
    output_schema  TEXT,
    policy         TEXT
);

CREATE TABLE rate_buckets (
    key           TEXT PRIMARY KEY,
    window_start  REAL NOT NULL,
    count         INTEGER NOT NULL
) WITHOUT ROWID;
