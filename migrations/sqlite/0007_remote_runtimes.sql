-- Remote runtimes (docs/runtime-protocol.md): the runs Switchboard admitted
-- on one and waits for, with where their answers go, and each runtime's
-- event cursor (the last durable event id processed).
CREATE TABLE remote_runs (
    runtime          TEXT    NOT NULL,
    run_id           TEXT    NOT NULL,
    conversation_id  INTEGER NOT NULL,
    account          TEXT    NOT NULL,
    chat_id          TEXT    NOT NULL,
    thread_id        TEXT    NOT NULL DEFAULT '',
    surface          TEXT    NOT NULL,
    reply_to         TEXT,
    -- A /stop confirmation to send after the run's last words, as JSON
    -- {"item_key", "text"}.
    end_notice       TEXT,
    -- awaited | finished
    state            TEXT    NOT NULL,
    event_id         INTEGER,
    created_at       INTEGER NOT NULL,
    finished_at      INTEGER,
    PRIMARY KEY (runtime, run_id)
);
CREATE INDEX remote_runs_awaited ON remote_runs (runtime, created_at, run_id)
    WHERE state = 'awaited';
CREATE INDEX remote_runs_of_conversation ON remote_runs (runtime, conversation_id)
    WHERE state = 'awaited';

CREATE TABLE remote_cursors (
    runtime   TEXT PRIMARY KEY,
    event_id  INTEGER NOT NULL
);
