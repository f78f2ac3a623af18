-- Task records may hold a federated evaluation taking reports (`evaluating`: its running sums
-- and who reported), and history entries its result (`evaluation`). A hora-server from before
-- could write a task back without the reports it counted: it refuses this database instead
-- (its migrations stop at 0003), as it refuses a sled store of format 3. No table changes.
COMMENT ON TABLE history IS 'Round history entries (JSON). Since migration 0004 an entry may hold its federated evaluation.';
