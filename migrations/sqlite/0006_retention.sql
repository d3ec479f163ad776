-- Retention: when an operator purged a conversation (its journal rows stay
-- as key-only tombstones, so a late duplicate cannot recreate it), and the
-- watermarks of the pruning passes.
ALTER TABLE conversations ADD COLUMN purged_at INTEGER;

CREATE TABLE housekeeping (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
