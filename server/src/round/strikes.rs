//! Strikes and quarantine. A client earns a strike for each update refused as invalid or out of
//! bounds, and for each attempt abandoned short that it was selected for (and told so, durably)
//! and never sent an upload to (traced to it: the round failed because such clients took a place
//! and starved it; see [`super::Collection::strikes_dropouts`]); an accepted update starts the
//! count again. At `--quarantine-after` strikes in a row the client is quarantined: refused
//! everything until the operator releases it, so a client that keeps sending poison, or keeps
//! taking a place in rounds it then starves, costs the server one refusal, not one per round for
//! ever.

use super::{now_ms, Coordinator};
use crate::error::ServerError;

impl Coordinator {
    /// Counts a strike against `client` for `why`, or starts its count again (`None`), durably
    /// and atomically with any other change to the client. Blocking.
    pub fn strike(&self, client: &str, why: Option<&str>) {
        let after = self.config.quarantine_after;
        if after == 0 {
            return;
        }
        match self.count_strike(client, why, after) {
            Ok(Some(reason)) => {
                self.metrics.clients_quarantined.inc();
                tracing::warn!(client = %client, reason = ?reason, "client quarantined: it is refused everything until the operator releases it");
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(client = %client, error = %e, "could not count a strike against the client")
            }
        }
    }

    fn count_strike(
        &self,
        client: &str,
        why: Option<&str>,
        after: u32,
    ) -> Result<Option<String>, ServerError> {
        let store = self.store();
        if why.is_none() && store.client(client)?.is_none_or(|c| c.strikes == 0) {
            return Ok(None); // nothing to start again: no write
        }
        let why = why.map(|w| w.chars().take(300).collect::<String>());
        let mut quarantined = None;
        store.update_client(client, &mut |c| {
            quarantined = None;
            match &why {
                None => c.strikes = 0,
                Some(_) if c.quarantined.is_some() => {}
                Some(last) => {
                    c.strikes = c.strikes.saturating_add(1);
                    if c.strikes >= after {
                        let reason = format!("{} strikes in a row; the last: {last}", c.strikes);
                        quarantined = Some(reason.clone());
                        c.quarantined = Some(crate::store::Quarantine {
                            since_unix_ms: now_ms(),
                            reason,
                        });
                    }
                }
            }
        })?;
        if quarantined.is_some() {
            store.flush()?;
        }
        Ok(quarantined)
    }
}
