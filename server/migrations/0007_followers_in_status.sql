-- Whether a replica that does not lead serves clients (it follows) or only stands by, as it last
-- said in its heartbeat: `hora-server status` shows which.
ALTER TABLE replicas ADD COLUMN following boolean NOT NULL DEFAULT false;
