//! A round attempt's phase, as a type, and the only transitions between phases.
//!
//! ```text
//!              begin_close              closed(Publish)
//! Collecting ─────────────▶ Closing ─────────────────────▶ Published
//!     ▲                      │  │      closed(Abandon(r))
//!     └── close_failed ──────┘  └─────────────────────────▶ Abandoned(r)
//!         (plain: collect on)   close_failed (secure: the same
//!                               ending again) ─▶ Retrying(e) ─begin_close─▶ Closing
//! ```
//!
//! Only a collecting round takes joins and updates. A close that fails (storage trouble) either
//! goes back to collecting — a plain round's sum can still take updates, and the deadline watcher
//! closes it again — or, when the mode cannot collect any more (a secure-aggregation attempt
//! whose stages are over), waits in `Retrying` with the ending it must reach.

/// How a close ends an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// Publish the sum if it holds enough updates (the close abandons it otherwise).
    Publish,
    /// Abandon the attempt for this reason; the round is retried.
    Abandon(String),
}

/// Where a round attempt is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Taking joins and updates.
    Collecting,
    /// Being tallied and published or abandoned: nothing more is taken.
    Closing,
    /// A close failed and must be tried again with this ending; nothing more is taken.
    Retrying(Ending),
    /// Its model is the task's global model now.
    Published,
    /// It ended without a model, for this reason.
    Abandoned(String),
}

/// A transition that the phase does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a round that is {from:?} cannot {what}")]
pub struct BadTransition {
    pub from: Phase,
    pub what: &'static str,
}

impl Phase {
    /// Whether joins and updates are taken.
    pub fn is_collecting(&self) -> bool {
        matches!(self, Phase::Collecting)
    }

    /// Whether the attempt is over (published or abandoned).
    pub fn is_ended(&self) -> bool {
        matches!(self, Phase::Published | Phase::Abandoned(_))
    }

    /// Collecting or retrying → closing. `Ok(false)` when a close is already running or the
    /// attempt has ended: there is nothing for this caller to do.
    pub fn begin_close(&mut self) -> Result<bool, BadTransition> {
        match self {
            Phase::Collecting | Phase::Retrying(_) => {
                *self = Phase::Closing;
                Ok(true)
            }
            Phase::Closing | Phase::Published | Phase::Abandoned(_) => Ok(false),
        }
    }

    /// Closing → collecting (`retry` None: the mode can take updates again) or → retrying.
    pub fn close_failed(&mut self, retry: Option<Ending>) -> Result<(), BadTransition> {
        if *self != Phase::Closing {
            return Err(self.refuse("fail a close it is not in"));
        }
        *self = match retry {
            None => Phase::Collecting,
            Some(ending) => Phase::Retrying(ending),
        };
        Ok(())
    }

    /// Closing → published, or → abandoned with the reason.
    pub fn closed(&mut self, outcome: Result<(), String>) -> Result<(), BadTransition> {
        if *self != Phase::Closing {
            return Err(self.refuse("end without closing"));
        }
        *self = match outcome {
            Ok(()) => Phase::Published,
            Err(reason) => Phase::Abandoned(reason),
        };
        Ok(())
    }

    fn refuse(&self, what: &'static str) -> BadTransition {
        BadTransition {
            from: self.clone(),
            what,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_collects_closes_and_publishes() {
        let mut p = Phase::Collecting;
        assert!(p.is_collecting());
        assert_eq!(p.begin_close(), Ok(true));
        assert_eq!(p, Phase::Closing);
        assert!(!p.is_collecting());
        p.closed(Ok(())).unwrap();
        assert_eq!(p, Phase::Published);
        assert!(p.is_ended());
    }

    #[test]
    fn a_round_can_be_abandoned_with_its_reason() {
        let mut p = Phase::Collecting;
        p.begin_close().unwrap();
        p.closed(Err("2 of the required 3".into())).unwrap();
        assert_eq!(p, Phase::Abandoned("2 of the required 3".into()));
        assert!(p.is_ended());
    }

    #[test]
    fn a_second_close_finds_nothing_to_do() {
        let mut p = Phase::Collecting;
        assert_eq!(p.begin_close(), Ok(true));
        assert_eq!(p.begin_close(), Ok(false));
        p.closed(Ok(())).unwrap();
        assert_eq!(p.begin_close(), Ok(false));
        assert_eq!(p, Phase::Published);
    }

    #[test]
    fn a_failed_close_collects_again_or_waits_to_retry_its_ending() {
        let mut p = Phase::Collecting;
        p.begin_close().unwrap();
        p.close_failed(None).unwrap();
        assert_eq!(p, Phase::Collecting);

        p.begin_close().unwrap();
        p.close_failed(Some(Ending::Abandon("too few".into())))
            .unwrap();
        assert_eq!(p, Phase::Retrying(Ending::Abandon("too few".into())));
        assert!(!p.is_collecting() && !p.is_ended());
        assert_eq!(p.begin_close(), Ok(true));
        assert_eq!(p, Phase::Closing);
    }

    #[test]
    fn transitions_out_of_order_are_refused() {
        let mut p = Phase::Collecting;
        assert!(p.closed(Ok(())).is_err());
        assert!(p.close_failed(None).is_err());
        assert_eq!(p, Phase::Collecting);
        let mut ended = Phase::Published;
        assert!(ended.close_failed(None).is_err());
        assert!(ended.closed(Err("x".into())).is_err());
        assert_eq!(ended, Phase::Published);
    }
}
