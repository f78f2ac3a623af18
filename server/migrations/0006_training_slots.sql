-- Asynchronous (FedBuff) tasks served by every replica: the training slots clients hold, one
-- row each, so that a task's concurrency holds across replicas and a client that joined at one
-- replica may upload at another. A slot is taken under an advisory lock on the task's id, lapses
-- at `until_ms` (the database's clock, Unix ms; a lapsed row counts for nothing, and its
-- client's next slot replaces it), and is spent when the update it was given for is durable
-- (the replica's partial, the leader's checkpoint, or the close that holds it). The rows of a
-- task go with its last round.
CREATE TABLE training_slots (
    task     text COLLATE "C" NOT NULL,
    client   text COLLATE "C" NOT NULL,
    until_ms bigint NOT NULL,
    PRIMARY KEY (task, client)
);
