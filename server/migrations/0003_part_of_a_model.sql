-- Task records may hold a task that trains part of its model (`part` in the record, `trainable`
-- in its configuration). A hora-server from before could read such a task without them and
-- write it back so, losing where its frozen base is: it refuses this database instead (its
-- migrations stop at 0002), as it refuses a sled store of format 2. No table changes.
COMMENT ON TABLE tasks IS 'Task records (JSON). Since migration 0003 a task may train part of its model.';
