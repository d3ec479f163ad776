-- Access control: whether an update addressed the bot (a mention, a reply
-- to the bot, a command to it; always true in private chats), and the
-- pairing of unknown direct-message users with operators.

ALTER TABLE inbound ADD COLUMN addressed INTEGER NOT NULL DEFAULT 1;

CREATE TABLE pairings (
    account     TEXT    NOT NULL,
    user_id     TEXT    NOT NULL,
    user_name   TEXT,
    code        TEXT    NOT NULL,
    state       TEXT    NOT NULL,
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    decided_at  INTEGER,
    PRIMARY KEY (account, user_id)
);
CREATE UNIQUE INDEX pairings_by_code ON pairings (code);
