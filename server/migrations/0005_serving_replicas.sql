-- Replicas that serve clients without leading (every replica answers any client of a plain
-- round): what they share of an open attempt, beside the leader's open round record. Every row
-- names its attempt (task, round, attempt); the leader's close of an attempt seals it, and the
-- transaction that records the close deletes the task's rows.

-- The clients selected for an attempt, by whichever replica took their join: one row each, so
-- that a capacity is kept across replicas (selections of one task are serialised by an
-- advisory lock on its id). The leader's own record may list some of them too.
CREATE TABLE round_selections (
    task    text COLLATE "C" NOT NULL,
    round   bigint NOT NULL CHECK (round >= 0),
    attempt bigint NOT NULL CHECK (attempt >= 0),
    client  text COLLATE "C" NOT NULL,
    PRIMARY KEY (task, round, attempt, client)
);

-- Which replica folds each client's update of an attempt: taken before the fold, so that a
-- retry sent to another replica (its acknowledgement lost) is never folded twice.
CREATE TABLE round_claims (
    task    text COLLATE "C" NOT NULL,
    round   bigint NOT NULL CHECK (round >= 0),
    attempt bigint NOT NULL CHECK (attempt >= 0),
    client  text COLLATE "C" NOT NULL,
    replica text COLLATE "C" NOT NULL,
    PRIMARY KEY (task, round, attempt, client)
);

-- Each serving replica's durable partial sum of an attempt (JSON: its checkpoint blob, total
-- weight and contributions), replaced at each of its group commits; the leader merges them
-- when it closes the attempt.
CREATE TABLE round_partials (
    task    text COLLATE "C" NOT NULL,
    round   bigint NOT NULL CHECK (round >= 0),
    attempt bigint NOT NULL CHECK (attempt >= 0),
    replica text COLLATE "C" NOT NULL,
    record  bytea NOT NULL,
    PRIMARY KEY (task, round, attempt, replica)
);

-- The attempt each task's leader is closing: from then on no replica selects, or records a
-- partial, for it.
CREATE TABLE round_seals (
    task    text COLLATE "C" PRIMARY KEY,
    round   bigint NOT NULL CHECK (round >= 0),
    attempt bigint NOT NULL CHECK (attempt >= 0)
);

-- A partial recorded wakes the leader (a round may be full).
CREATE TRIGGER round_partials_changed AFTER INSERT OR UPDATE ON round_partials
    FOR EACH ROW EXECUTE FUNCTION hora_task_changed();
