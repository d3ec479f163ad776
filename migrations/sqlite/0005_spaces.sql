-- The space a chat belongs to (a Discord guild), for access decisions by
-- guild; NULL where platforms have none.
ALTER TABLE conversations ADD COLUMN space TEXT;
