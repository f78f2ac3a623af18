//! The plain round mode, and the default of every step of the [`Collection`] seam: clients join
//! until the round has its target plus the over-selection, upload their delta sealed to the
//! round's key ([`super::upload`]), and each update is folded into the round's running sum the
//! moment it arrives.

use std::sync::Arc;

use hora_common::wire::ErrorCode;

use super::collection::{Collection, Folded, Joined, Opened};
use super::upload::{Admission, Sealing};
use super::{capacity, lock, Round, Task};
use crate::error::ServerError;
use crate::store::TaskRecord;

/// Sealed uploads, folded as they arrive: every step as the seam's defaults have it.
pub struct PlainCollection;

impl Collection for PlainCollection {
    fn mode(&self) -> &'static str {
        "plain"
    }
}

/// Selects `client` for `round` if the task's strategy admits it (by default: while fewer than
/// the round's capacity are selected). A repeat join of a selected client writes nothing and
/// wakes nobody. Blocking.
pub(crate) fn select(
    task: &Task,
    record: &TaskRecord,
    round: &Arc<Round>,
    client: &str,
) -> Result<Joined, ServerError> {
    let mut acc = lock(&round.acc);
    if acc.contributions.iter().any(|c| c.client == client) {
        return Err(already_contributed(client, round.number));
    }
    let upto = match acc.selected.contains(client) {
        true => acc.selected.len(),
        false => {
            if !acc.phase.is_collecting()
                || !task
                    .strategy
                    .admits(client, acc.selected.len(), capacity(&record.config))
            {
                return Ok(Joined::Wait);
            }
            // Recorded by the next commit, which the join waits for.
            acc.selected.insert(client.to_string());
            lock(&round.roster).selected.insert(client.to_string());
            let upto = acc.selected.len();
            drop(acc);
            task.bump();
            upto
        }
    };
    Ok(Joined::offered(round, record, round.deadline(), upto))
}

/// A plain upload's checks: it is for the open round, which is still collecting, from a client
/// selected for it, and not a repeat of an update already durable. Blocking.
pub(crate) fn check_upload(
    round: &Arc<Round>,
    client: &str,
    number: u64,
) -> Result<Admission, ServerError> {
    if number != round.number {
        let code = match number < round.number {
            true => ErrorCode::RoundClosed,
            false => ErrorCode::WrongRound,
        };
        return Err(ServerError::conflict(
            code,
            format!(
                "round {number} is not open; the open round is {}",
                round.number
            ),
        ));
    }
    let mut acc = lock(&round.acc);
    if !acc.phase.is_collecting() {
        return Err(ServerError::conflict(
            ErrorCode::RoundClosed,
            format!("round {} is closing", round.number),
        ));
    }
    if !acc.selected.contains(client) {
        return Err(ServerError::conflict(
            ErrorCode::NotSelected,
            format!(
                "client `{client}` is not selected for round {}: join it first",
                round.number
            ),
        ));
    }
    match acc.contributions.iter().position(|c| c.client == client) {
        Some(index) if index < acc.durable => Err(already_contributed(client, round.number)),
        Some(index) => Ok(Admission::Pending(round.clone(), index)),
        None => {
            acc.tried.insert(client.to_string());
            Ok(Admission::Fresh(round.clone(), Sealing::Current))
        }
    }
}

/// Folds an opened update into `round`'s sum, re-checking under the round's lock that the round
/// still collects and that no retry of the same update raced it. Blocking.
pub(crate) fn fold(round: &Arc<Round>, opened: Opened<'_>) -> Result<Folded, ServerError> {
    let mut acc = lock(&round.acc);
    if !acc.phase.is_collecting() {
        return Err(ServerError::conflict(
            ErrorCode::RoundClosed,
            format!(
                "round {} closed while the update was being checked",
                round.number
            ),
        ));
    }
    let client = &opened.update.client;
    if let Some(index) = acc.contributions.iter().position(|c| c.client == *client) {
        // A retry raced its own first attempt: answer as the first is answered.
        return Ok(Folded {
            round: round.clone(),
            index,
            now: false,
        });
    }
    acc.sum
        .add_update_scaled(opened.weight, opened.scale, opened.view)
        .map_err(|e| ServerError::InvalidUpdate(e.to_string()))?;
    lock(&round.roster).contributed(client);
    acc.behind = acc
        .behind
        .saturating_add(opened.update.contributors.saturating_sub(1));
    acc.contributions.push(opened.update);
    Ok(Folded {
        round: round.clone(),
        index: acc.contributions.len() - 1,
        now: true,
    })
}

pub(crate) fn already_contributed(client: &str, round: u64) -> ServerError {
    ServerError::conflict(
        ErrorCode::AlreadyContributed,
        format!("client `{client}` has already uploaded its update for round {round}"),
    )
}
