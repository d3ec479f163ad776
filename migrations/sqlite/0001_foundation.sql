-- The foundation schema: conversations, the inbound journal, runs of the
-- built-in runtime, and the outbox. Times are milliseconds since the Unix
-- epoch. An absent thread is stored as '' so it can take part in unique keys.

-- A conversation is the lane of one (account, chat, thread); `/new` closes
-- the current one and opens another for the same chat.
CREATE TABLE conversations (
    id          INTEGER PRIMARY KEY,
    account     TEXT    NOT NULL,
    chat_id     TEXT    NOT NULL,
    thread_id   TEXT    NOT NULL DEFAULT '',
    chat_kind   TEXT    NOT NULL,
    surface     TEXT    NOT NULL,
    created_at  INTEGER NOT NULL,
    closed_at   INTEGER
);
CREATE UNIQUE INDEX conversations_current
    ON conversations (account, chat_id, thread_id) WHERE closed_at IS NULL;

-- The inbound journal: one row per (account, platform update key), forever
-- unique (payloads may be pruned; keys are kept).
CREATE TABLE inbound (
    id              INTEGER PRIMARY KEY,
    account         TEXT    NOT NULL,
    update_key      TEXT    NOT NULL,
    conversation_id INTEGER NOT NULL REFERENCES conversations (id),
    sender_id       TEXT,
    sender_name     TEXT,
    message_id      TEXT,
    payload         TEXT,
    input_policy    TEXT,
    disposition     TEXT    NOT NULL,
    reason          TEXT,
    submission_key  TEXT    NOT NULL,
    run_id          TEXT,
    received_at     INTEGER NOT NULL,
    settled_at      INTEGER,
    UNIQUE (account, update_key)
);
-- The submitter's queue: rows not yet handed to a runtime.
CREATE INDEX inbound_pending ON inbound (id) WHERE disposition = 'pending';
CREATE INDEX inbound_by_conversation ON inbound (conversation_id, id);
CREATE INDEX inbound_by_disposition ON inbound (disposition, id);

-- Runs of the built-in runtime. Within a conversation they execute by
-- (priority DESC, id): urgent inputs first, FIFO otherwise. `mode` is
-- `ordinary` (may take coalesced inputs while queued), `inject` (offered to
-- the running run at its next step boundary) or `urgent` (interrupt-next).
CREATE TABLE runs (
    id              INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL,
    runtime         TEXT    NOT NULL,
    account         TEXT    NOT NULL,
    chat_id         TEXT    NOT NULL,
    thread_id       TEXT    NOT NULL DEFAULT '',
    surface         TEXT    NOT NULL,
    reply_to        TEXT,
    mode            TEXT    NOT NULL,
    state           TEXT    NOT NULL,
    priority        INTEGER NOT NULL DEFAULT 0,
    -- For `interrupt_requested`: the terminal state it ends in
    -- (`interrupted` or `superseded`).
    end_as          TEXT,
    -- A confirmation to send after the run's last words (`/stop`), as JSON
    -- {"item_key", "text"}.
    end_notice      TEXT,
    -- The user turns this run answered, as a JSON array of strings, and its
    -- answer (partial for an interrupted run): the conversation history.
    prompt          TEXT,
    answer          TEXT,
    reason          TEXT,
    -- For `absorbed`: the run that answered this one's inputs.
    absorbed_by     INTEGER,
    created_at      INTEGER NOT NULL,
    started_at      INTEGER,
    finished_at     INTEGER
);
CREATE INDEX runs_unfinished ON runs (id)
    WHERE state IN ('queued', 'running', 'interrupt_requested');
CREATE INDEX runs_by_conversation ON runs (conversation_id, id);
-- A conversation's runs that are not finished (what /stop acts on).
CREATE INDEX runs_active ON runs (conversation_id, id)
    WHERE state IN ('queued', 'running', 'interrupt_requested');
-- The history of a conversation: runs whose answer reaches later prompts,
-- in the order they finished (an urgent run can finish before an older one).
CREATE INDEX runs_history ON runs (conversation_id, finished_at)
    WHERE state IN ('completed', 'interrupted');

-- Inputs: what was submitted, under which idempotency key, owned by which
-- run. Coalescing puts several inputs in one run.
CREATE TABLE run_inputs (
    id              INTEGER PRIMARY KEY,
    idempotency_key TEXT    NOT NULL UNIQUE,
    run_id          INTEGER NOT NULL REFERENCES runs (id),
    conversation_id INTEGER NOT NULL,
    inbound_id      INTEGER,
    input           TEXT    NOT NULL,
    created_at      INTEGER NOT NULL
);
CREATE INDEX run_inputs_by_run ON run_inputs (run_id, id);

-- Durable run events (terminal records), written in the same transaction as
-- the run's reply items. The id is the durable event id.
CREATE TABLE run_events (
    id              INTEGER PRIMARY KEY,
    run_id          INTEGER NOT NULL,
    conversation_id INTEGER NOT NULL,
    kind            TEXT    NOT NULL,
    state           TEXT    NOT NULL,
    payload         TEXT    NOT NULL,
    created_at      INTEGER NOT NULL
);
CREATE INDEX run_events_by_run ON run_events (run_id, id);

-- The outbox. `head` marks the item its lane is waiting on: the lowest
-- ordinal of the conversation that is still not_dispatched or
-- possibly_dispatched. Only heads are claimed, so a claim reads a bounded
-- number of rows however long the backlog of one conversation is.
CREATE TABLE outbox (
    id               INTEGER PRIMARY KEY,
    item_key         TEXT    NOT NULL UNIQUE,
    conversation_id  INTEGER NOT NULL,
    ordinal          INTEGER NOT NULL,
    account          TEXT    NOT NULL,
    chat_id          TEXT    NOT NULL,
    thread_id        TEXT    NOT NULL DEFAULT '',
    surface          TEXT    NOT NULL,
    reply_to         TEXT,
    run_id           TEXT,
    kind             TEXT    NOT NULL,
    text             TEXT    NOT NULL,
    -- The chunks of one answer share a group: when one fails for good, the
    -- later ones fail with it.
    group_key        TEXT,
    -- The item whose message this one edits when that message exists (a
    -- streaming preview).
    edits_key        TEXT,
    state            TEXT    NOT NULL,
    head             INTEGER NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    resends          INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  INTEGER NOT NULL,
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    fencing_token    INTEGER NOT NULL DEFAULT 0,
    dispatched_at    INTEGER,
    receipt          TEXT,
    reason           TEXT,
    created_at       INTEGER NOT NULL,
    settled_at       INTEGER,
    UNIQUE (conversation_id, ordinal)
);
CREATE INDEX outbox_ready ON outbox (next_attempt_at)
    WHERE state = 'not_dispatched' AND head = 1;
CREATE INDEX outbox_lane ON outbox (conversation_id, ordinal)
    WHERE state IN ('not_dispatched', 'possibly_dispatched');
CREATE INDEX outbox_in_flight ON outbox (lease_expires_at)
    WHERE state = 'possibly_dispatched';
CREATE INDEX outbox_by_state ON outbox (state, id);
-- Whether a preview was replaced (its answer, a failure notice or a discard
-- marker exists): transient edits stop then.
CREATE INDEX outbox_edits ON outbox (edits_key) WHERE edits_key IS NOT NULL;
CREATE INDEX outbox_group ON outbox (group_key, ordinal)
    WHERE group_key IS NOT NULL AND state = 'not_dispatched';
