-- Secure aggregation across replicas: a change of a task's protocol records (a stage's
-- message taken by any replica, the leader's stage record) notifies the change feed with the
-- task's id (the key's first part, up to its first \0), so the leader counts the messages
-- other replicas took and the followers learn when a stage moves on.
CREATE FUNCTION hora_secagg_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    k bytea;
BEGIN
    IF TG_OP = 'DELETE' THEN
        k := OLD.key;
    ELSE
        k := NEW.key;
    END IF;
    IF position('\x00'::bytea IN k) > 1 THEN
        PERFORM pg_notify('hora_changes',
            convert_from(substring(k FROM 1 FOR position('\x00'::bytea IN k) - 1), 'UTF8'));
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER secagg_changed AFTER INSERT OR UPDATE OR DELETE ON secagg
    FOR EACH ROW EXECUTE FUNCTION hora_secagg_changed();
