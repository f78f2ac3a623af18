-- Replicas on one database (`hora-server serve --store postgres://…` more than once): which one
-- leads, and who is there.
--
-- A lease is a row with an expiry, judged by the database's clock (never a replica's), and a
-- fencing token: `epoch` grows by one each time a replica takes the lease. The holder renews it
-- well before it expires; another replica takes it only once it has expired (its holder is gone
-- or cut off). Every write a leader makes checks, in its own transaction, that it still holds
-- the lease under its epoch (FOR KEY SHARE); taking the lease locks the row FOR UPDATE, which
-- waits for those writes to commit, and every write after the take fails, so a leader that lost
-- its lease can never publish. Renewals update the row without conflicting with the writes.
-- `scope` is `server` (the whole database) today.
CREATE TABLE leases (
    scope      text COLLATE "C" PRIMARY KEY,
    holder     text NOT NULL,
    epoch      bigint NOT NULL CHECK (epoch > 0),
    -- Where the holder serves (its host and --listen address), for `hora-server status`.
    address    text NOT NULL,
    -- The lease's length, as its holder renews it.
    ttl_ms     bigint NOT NULL CHECK (ttl_ms > 0),
    taken_at   timestamptz NOT NULL,
    renewed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);

-- Every replica that runs on this database, leading or standing by, with its last heartbeat.
-- A replica removes its row when it stops; a row not seen for a day is removed by the leader.
CREATE TABLE replicas (
    id         text COLLATE "C" PRIMARY KEY,
    address    text NOT NULL,
    version    text NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at    timestamptz NOT NULL
);
