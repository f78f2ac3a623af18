//! What this server saw of each client since it started: when it last presented its
//! credentials and how many of its updates were accepted (the dashboard's clients page). Kept in
//! memory only: a write to the store per request would cost every client request a commit.

use std::collections::HashMap;
use std::sync::Mutex;

use super::now_ms;

#[derive(Default)]
pub struct ClientsSeen(Mutex<HashMap<String, Seen>>);

#[derive(Default, Clone, Copy)]
struct Seen {
    last_unix_ms: u64,
    contributions: u64,
}

impl ClientsSeen {
    /// `client` presented good credentials now. (Bounded by the enrolled clients: only
    /// authenticated ones are noted.)
    pub fn seen(&self, client: &str) {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = now_ms();
        match seen.get_mut(client) {
            Some(s) => s.last_unix_ms = now,
            None => {
                seen.insert(
                    client.to_string(),
                    Seen {
                        last_unix_ms: now,
                        contributions: 0,
                    },
                );
            }
        }
    }

    /// An update of `client` was accepted.
    pub fn contributed(&self, client: &str) {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let s = seen.entry(client.to_string()).or_default();
        s.contributions += 1;
        s.last_unix_ms = now_ms();
    }

    /// When `client` was last seen (if since the start) and its accepted updates.
    pub fn of(&self, client: &str) -> (Option<u64>, u64) {
        let seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(client)
            .map_or((None, 0), |s| (Some(s.last_unix_ms), s.contributions))
    }
}
