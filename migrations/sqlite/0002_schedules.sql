-- Durable schedules and their occurrences, chat settings (time zones), and
-- the channel accounts a daemon registered (so operator tools can name an
-- account by its configured name).

CREATE TABLE channel_accounts (
    name        TEXT PRIMARY KEY,
    identity    TEXT NOT NULL,
    platform    TEXT NOT NULL,
    updated_at  INTEGER NOT NULL
);

CREATE TABLE chat_settings (
    account     TEXT NOT NULL,
    chat_id     TEXT NOT NULL,
    timezone    TEXT,
    updated_at  INTEGER NOT NULL,
    PRIMARY KEY (account, chat_id)
);

-- kind: at | after | every. An `every` schedule has a cron expression and a
-- required IANA zone; `at` and `after` are stored as the instant they fire.
CREATE TABLE schedules (
    id            INTEGER PRIMARY KEY,
    kind          TEXT    NOT NULL,
    spec          TEXT    NOT NULL,
    cron          TEXT,
    timezone      TEXT,
    action        TEXT    NOT NULL,
    text          TEXT    NOT NULL,
    account       TEXT    NOT NULL,
    chat_id       TEXT    NOT NULL,
    thread_id     TEXT    NOT NULL DEFAULT '',
    chat_kind     TEXT    NOT NULL,
    surface       TEXT    NOT NULL,
    state         TEXT    NOT NULL,
    next_due_at   INTEGER,
    missed_policy TEXT    NOT NULL,
    max_attempts  INTEGER NOT NULL,
    fired         INTEGER NOT NULL DEFAULT 0,
    failed        INTEGER NOT NULL DEFAULT 0,
    skipped       INTEGER NOT NULL DEFAULT 0,
    created_by    TEXT    NOT NULL,
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
);
-- The index of next-due slots.
CREATE INDEX schedules_due ON schedules (next_due_at) WHERE state = 'active';
CREATE INDEX schedules_by_chat ON schedules (account, chat_id, id);

-- One row per (schedule, slot): the occurrence key is the submission
-- idempotency key (prompt) or the reply item key (message).
CREATE TABLE occurrences (
    id               INTEGER PRIMARY KEY,
    schedule_id      INTEGER NOT NULL REFERENCES schedules (id),
    slot_at          INTEGER NOT NULL,
    occurrence_key   TEXT    NOT NULL UNIQUE,
    state            TEXT    NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  INTEGER NOT NULL,
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    fencing_token    INTEGER NOT NULL DEFAULT 0,
    reason           TEXT,
    run_id           TEXT,
    fired_at         INTEGER,
    created_at       INTEGER NOT NULL,
    UNIQUE (schedule_id, slot_at)
);
CREATE INDEX occurrences_due ON occurrences (next_attempt_at) WHERE state = 'pending';
CREATE INDEX occurrences_claimed ON occurrences (lease_expires_at) WHERE state = 'claimed';
CREATE INDEX occurrences_by_schedule ON occurrences (schedule_id, slot_at);
