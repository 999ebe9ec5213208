-- Version 1 of the phones' cache. Every synced row carries confirmed_at_ms: when the server last confirmed it.

CREATE TABLE meta (
    -- What this database belongs to (server_url, org): one database per account.
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    started_at_ms INTEGER NOT NULL,
    -- The run's event-log version: an older snapshot never overwrites a newer one.
    version INTEGER NOT NULL,
    -- The loams.factory.v1.Run message as the server sent it.
    proto BLOB NOT NULL,
    confirmed_at_ms INTEGER NOT NULL
);
CREATE INDEX runs_by_start ON runs (started_at_ms DESC, id);

CREATE TABLE timeline_events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    at_ms INTEGER NOT NULL,
    kind TEXT NOT NULL,
    stage TEXT NOT NULL,
    summary TEXT NOT NULL,
    detail_json TEXT NOT NULL,
    confirmed_at_ms INTEGER NOT NULL,
    PRIMARY KEY (run_id, seq)
) WITHOUT ROWID;

CREATE TABLE approvals (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    -- loams.approvals.v1.ApprovalState number.
    state INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    -- The loams.approvals.v1.Approval message as the server sent it.
    proto BLOB NOT NULL,
    confirmed_at_ms INTEGER NOT NULL
);
CREATE INDEX approvals_by_state ON approvals (state, created_at_ms DESC);

CREATE TABLE device (
    -- This installation's registered device key (at most one row).
    slot INTEGER PRIMARY KEY CHECK (slot = 1),
    device_id TEXT NOT NULL,
    -- The loams.devices.v1.Device message.
    proto BLOB NOT NULL,
    confirmed_at_ms INTEGER NOT NULL
);

CREATE TABLE threads (
    id TEXT PRIMARY KEY,
    updated_at_ms INTEGER NOT NULL,
    -- The loams.bot.v1.Thread message.
    proto BLOB NOT NULL,
    confirmed_at_ms INTEGER NOT NULL
);
CREATE INDEX threads_by_update ON threads (updated_at_ms DESC, id);

CREATE TABLE messages (
    thread_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    id TEXT NOT NULL,
    role TEXT NOT NULL,
    author TEXT NOT NULL,
    content TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    run_id TEXT NOT NULL,
    confirmed_at_ms INTEGER NOT NULL,
    PRIMARY KEY (thread_id, seq)
) WITHOUT ROWID;

CREATE TABLE sync_cursors (
    -- e.g. 'timeline:<run id>', 'messages:<thread id>': the last seq stored, where a resumed sync starts.
    stream TEXT PRIMARY KEY,
    cursor INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL
);
