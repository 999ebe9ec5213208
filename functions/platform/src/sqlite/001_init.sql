-- Runs and their event logs. version = seq of the last event.
CREATE TABLE runs (
    org        TEXT    NOT NULL,
    id         TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    state      TEXT    NOT NULL,
    snapshot   BLOB    NOT NULL,
    created_ms INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL,
    PRIMARY KEY (org, id)
);
CREATE INDEX runs_by_created ON runs (org, created_ms, id);
CREATE INDEX runs_by_state ON runs (org, state, created_ms, id);

CREATE TABLE events (
    org  TEXT    NOT NULL,
    run  TEXT    NOT NULL,
    seq  INTEGER NOT NULL,
    body BLOB    NOT NULL,
    PRIMARY KEY (org, run, seq)
);

CREATE TABLE items (
    org        TEXT    NOT NULL,
    kind       TEXT    NOT NULL,
    id         TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    idx        TEXT,
    body       BLOB    NOT NULL,
    expires_ms INTEGER,
    PRIMARY KEY (org, kind, id)
);
CREATE INDEX items_by_idx ON items (org, kind, idx, id) WHERE idx IS NOT NULL;

CREATE TABLE idempotency (
    org            TEXT    NOT NULL,
    key            TEXT    NOT NULL,
    status         TEXT    NOT NULL CHECK (status IN ('in_progress', 'done')),
    result         BLOB,
    lease_until_ms INTEGER NOT NULL,
    updated_ms     INTEGER NOT NULL,
    PRIMARY KEY (org, key)
);

-- AUTOINCREMENT so a message id is never reused, which keeps receipts (id.receive_count) unique forever.
CREATE TABLE queue (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    body          BLOB    NOT NULL,
    visible_at_ms INTEGER NOT NULL,
    receive_count INTEGER NOT NULL DEFAULT 0,
    receipt       TEXT,
    sent_ms       INTEGER NOT NULL
);
CREATE INDEX queue_by_visible ON queue (visible_at_ms, id);
CREATE UNIQUE INDEX queue_by_receipt ON queue (receipt) WHERE receipt IS NOT NULL;

CREATE TABLE dead_letters (
    id            INTEGER PRIMARY KEY,
    body          BLOB    NOT NULL,
    receive_count INTEGER NOT NULL,
    dead_ms       INTEGER NOT NULL
);

CREATE TABLE timers (
    org     TEXT    NOT NULL,
    id      TEXT    NOT NULL,
    due_ms  INTEGER NOT NULL,
    payload BLOB    NOT NULL,
    PRIMARY KEY (org, id)
);
CREATE INDEX timers_by_due ON timers (due_ms, org, id);
