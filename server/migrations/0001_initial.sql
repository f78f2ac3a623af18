-- Hora's records in PostgreSQL (`--store postgres://…`), as the sled store keeps them.
--
-- Each record is the same JSON the sled store writes, as bytea (jsonb would refuse the \u0000 a
-- client's label may hold; `convert_from(record, 'UTF8')::jsonb` reads one), under real key
-- columns; what the store looks up by (a round's number, the model a round published, whether
-- it is pruned) is a column of its own, indexed. Keys are compared byte by byte (COLLATE "C"),
-- as sled orders them, whatever the database's locale.
--
-- Applied once, in the same transaction as its record in hora_migrations. Never edit this file
-- once shipped: change the schema in a new file (0002_….sql) listed in migrate.rs.

CREATE TABLE tasks (
    task   text COLLATE "C" PRIMARY KEY,
    record bytea NOT NULL
);

-- The round each task has open (none once it has ended).
CREATE TABLE open_rounds (
    task   text COLLATE "C" PRIMARY KEY,
    record bytea NOT NULL
);

-- Every attempt of every finished round.
CREATE TABLE history (
    task    text COLLATE "C" NOT NULL,
    round   bigint NOT NULL CHECK (round >= 0),
    attempt bigint NOT NULL CHECK (attempt >= 0),
    -- The digest (32 bytes) of the model the attempt published, if it published one.
    model   bytea,
    -- Its model file is out of retention (and deleted unless something else uses it).
    pruned  boolean NOT NULL,
    record  bytea NOT NULL,
    PRIMARY KEY (task, round, attempt)
);

-- Whether any unpruned round still names a model: one index lookup, however long the history.
CREATE INDEX history_models ON history (model) WHERE model IS NOT NULL AND NOT pruned;

-- How far pruning has looked in each task's history, and under which retention: every round
-- below `below` has been judged under (retain_last, retain_every), and every entry of a round
-- below `compacted_below` is compacted (its per-client lists down to their lengths).
CREATE TABLE prune_marks (
    task            text COLLATE "C" PRIMARY KEY,
    retain_last     bigint NOT NULL,
    retain_every    bigint NOT NULL,
    below           bigint NOT NULL,
    compacted_below bigint NOT NULL
);

CREATE TABLE clients (
    id     text COLLATE "C" PRIMARY KEY,
    record bytea NOT NULL
);

-- One-time enrolment tokens, by the hash of the token; deleted when spent.
CREATE TABLE enrolments (
    token_hash text COLLATE "C" PRIMARY KEY,
    record     bytea NOT NULL
);

CREATE TABLE sync_jobs (
    id     text COLLATE "C" PRIMARY KEY,
    record bytea NOT NULL
);

-- Secure aggregation's protocol records, keyed task\0kind\0client (bytes: text cannot hold \0).
CREATE TABLE secagg (
    key   bytea PRIMARY KEY,
    value bytea NOT NULL
);

-- Server-wide settings (the admin token's hash).
CREATE TABLE meta (
    key   text COLLATE "C" PRIMARY KEY,
    value text NOT NULL
);

-- The change feed: every committed change of a task, its open round or its history notifies
-- channel hora_changes with the task's id (PostgreSQL delivers it at commit, once per
-- transaction and id), so a replica's long polls wake on another replica's writes.
CREATE FUNCTION hora_task_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM pg_notify('hora_changes', OLD.task);
    ELSE
        PERFORM pg_notify('hora_changes', NEW.task);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_changed AFTER INSERT OR UPDATE OR DELETE ON tasks
    FOR EACH ROW EXECUTE FUNCTION hora_task_changed();
CREATE TRIGGER open_rounds_changed AFTER INSERT OR UPDATE OR DELETE ON open_rounds
    FOR EACH ROW EXECUTE FUNCTION hora_task_changed();
CREATE TRIGGER history_changed AFTER INSERT OR UPDATE OR DELETE ON history
    FOR EACH ROW EXECUTE FUNCTION hora_task_changed();
