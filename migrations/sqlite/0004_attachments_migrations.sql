-- Files a reply carries (a JSON array of attachment references: platform
-- file ids or URLs, never bytes); NULL for text-only replies.
ALTER TABLE outbox ADD COLUMN attachments TEXT;

-- Chats that became other chats (a Telegram group upgraded to a
-- supergroup): access decisions made for the old id carry over to the new.
CREATE TABLE chat_migrations (
    account     TEXT    NOT NULL,
    from_chat   TEXT    NOT NULL,
    to_chat     TEXT    NOT NULL,
    migrated_at INTEGER NOT NULL,
    PRIMARY KEY (account, to_chat, from_chat)
);
