-- Single-active roles (a Telegram bot's poller, a conversation's lane in the
-- built-in runtime): one holder at a time, renewed before it expires; a new
-- holder gets a higher token (fencing).
CREATE TABLE leases (
    name        TEXT    PRIMARY KEY,
    owner       TEXT    NOT NULL,
    token       INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL
);
