//! The change feed: a connection of its own that LISTENs on channel `hora_changes`, which the
//! schema's triggers notify with a task's id whenever a transaction that changes the task, its
//! open round or its history commits (whichever replica made it). Each notification goes to
//! every subscriber as [`StoreChange::Task`].
//!
//! The connection is made when the store opens (so a subscription taken after `open` hears of
//! every later commit), checked every few seconds, and made again whenever it is lost; after a
//! reconnection the feed says [`StoreChange::Missed`]: whatever a subscriber watches may have
//! changed unheard while it was down.

use std::time::Duration;

use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio_postgres::{AsyncMessage, Client, NoTls};

use super::driver::Target;
use crate::store::StoreChange;

/// The channel the schema's triggers notify (see `migrations/0001_initial.sql`).
const CHANNEL: &str = "hora_changes";
/// How often the connection is checked (a connection cut without a word is found out by the
/// check failing within as long again).
const HEARTBEAT: Duration = Duration::from_secs(5);
/// The longest wait between attempts to connect again.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A LISTENing connection: its client, and the task that reads its messages (it ends when the
/// connection does).
pub(super) struct Listening {
    client: Client,
    reader: JoinHandle<()>,
}

/// Connects, starts passing the connection's notifications to `changes`, and LISTENs.
pub(super) async fn listen(
    target: &Target,
    changes: broadcast::Sender<StoreChange>,
) -> Result<Listening, tokio_postgres::Error> {
    let (client, reader) = match target.tls() {
        Some(tls) => {
            let (client, connection) = target.config().connect(tls).await?;
            (client, tokio::spawn(read(connection, changes)))
        }
        None => {
            let (client, connection) = target.config().connect(NoTls).await?;
            (client, tokio::spawn(read(connection, changes)))
        }
    };
    client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
    Ok(Listening { client, reader })
}

/// Passes `connection`'s notifications to `changes` until it ends.
async fn read<S, T>(
    mut connection: tokio_postgres::Connection<S, T>,
    changes: broadcast::Sender<StoreChange>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    loop {
        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            Some(Ok(AsyncMessage::Notification(n))) if n.channel() == CHANNEL => {
                // No subscriber is not an error: the next one hears of later changes.
                let _ = changes.send(StoreChange::Task(n.payload().to_string()));
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                tracing::warn!(error = %e, "the PostgreSQL change feed's connection failed");
                return;
            }
            None => return,
        }
    }
}

/// Keeps the feed up for as long as the store's runtime runs: waits until the connection is
/// lost, connects again (backing off while the database is away), says `Missed`, and so on.
pub(super) async fn keep(
    target: Target,
    mut listening: Listening,
    changes: broadcast::Sender<StoreChange>,
) {
    loop {
        listening.until_lost().await;
        tracing::warn!(database = %target, "lost the PostgreSQL change feed's connection; connecting again");
        let mut backoff = Duration::from_millis(100);
        listening = loop {
            // (Bounded: a database that takes the connection and then stalls its handshake or
            // the LISTEN is tried again, not waited on for ever.)
            let attempt = tokio::time::timeout(2 * HEARTBEAT, listen(&target, changes.clone()));
            match attempt.await {
                Ok(Ok(listening)) => break listening,
                failed => {
                    let error = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => "no answer in time".into(),
                    };
                    tracing::debug!(%error, "the change feed cannot connect yet");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        };
        tracing::info!(database = %target, "the PostgreSQL change feed is back");
        let _ = changes.send(StoreChange::Missed);
    }
}

impl Listening {
    /// Returns once the connection is closed or stops answering.
    async fn until_lost(self) {
        let Listening { client, mut reader } = self;
        loop {
            tokio::select! {
                _ = &mut reader => return,
                () = tokio::time::sleep(HEARTBEAT) => {
                    let check = tokio::time::timeout(HEARTBEAT, client.simple_query("")).await;
                    if !matches!(check, Ok(Ok(_))) {
                        reader.abort();
                        return;
                    }
                }
            }
        }
    }
}
