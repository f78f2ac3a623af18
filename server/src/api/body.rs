//! Reading request bodies without letting a slow or hostile sender hold the server.
//!
//! - Size: a body is refused (413) from its `Content-Length` alone, before anything is read or
//!   allocated, and must be exactly as long as it said.
//! - Rate: a body must keep up an average of [`BodyRate::min_bytes_per_sec`] from its start,
//!   after a grace period; the moment it falls behind it is cut off with 408 `upload_too_slow`.
//!   A sender that stalls after four bytes is gone after the grace period, whatever length it
//!   announced.
//! - Memory: upload bodies are read into memory *before* they take one of the ingest slots
//!   (which bound the CPU work of opening and folding), under a byte budget. So a stalled body
//!   holds some budget for at most its rate-bounded time, never the slot everyone else needs;
//!   with small models thousands of bodies fit in the budget at once.
//! - Share: one upload reserves at most a share of the budget (a quarter by default), so a
//!   slow sender of a large body never holds the room everyone else reads in. The update must be
//!   whole in memory to be folded (it is one AES-GCM envelope, authenticated by the tag at its
//!   end: no byte of it may be folded before all of it is checked), so a body larger than the
//!   share cannot be read in slices; instead such bodies are read one at a time, each reserving
//!   the share: bodies in memory stay within the budget plus one larger body, smaller bodies
//!   keep the rest of the budget to themselves, and a large body waiting for its turn waits in
//!   its own queue, not at the head of everyone's. (Refusing them would refuse every model over
//!   16 MiB at the default budget.) An update larger than a chunk comes as chunks instead
//!   (`super::chunked`), each a body of its own, spooled to disk as it is opened.
//! - Disk, not memory, for the admin's models and modules ([`spool_body`]): they are written to
//!   an unnamed file in the spool directory as they arrive and checked through a read-only
//!   mapping, so a model of any size up to `--max-model-bytes` costs a write buffer while it
//!   travels.
//! - One upload per client and task in flight: a second one is refused (409
//!   `upload_in_progress`) rather than queued.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::header::CONTENT_LENGTH;
use axum::http::HeaderMap;
use hora_common::wire::ErrorCode;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Shared;
use crate::error::ServerError;

/// The slowest body the server waits for.
#[derive(Debug, Clone)]
pub struct BodyRate {
    pub min_bytes_per_sec: u64,
    pub grace: Duration,
}

impl Default for BodyRate {
    fn default() -> Self {
        BodyRate {
            min_bytes_per_sec: 16 << 10,
            grace: Duration::from_secs(10),
        }
    }
}

impl BodyRate {
    /// The floor for a body of `bytes` that must arrive within `within` (its task's round
    /// deadline): at least the configured floor, and fast enough to arrive in time, so a client
    /// selected for a large model cannot hold a share of the budget for hours.
    pub fn within(&self, bytes: u64, within: Duration) -> BodyRate {
        let needed = (bytes as f64 / within.as_secs_f64().max(1.0)).ceil() as u64;
        BodyRate {
            min_bytes_per_sec: self.min_bytes_per_sec.max(needed),
            grace: self.grace,
        }
    }

    /// When a body that has delivered `received` bytes falls behind the minimum rate.
    fn cutoff(&self, start: tokio::time::Instant, received: u64) -> tokio::time::Instant {
        let rate = self.min_bytes_per_sec.max(1) as f64;
        start + self.grace + Duration::from_secs_f64((received + 1) as f64 / rate)
    }
}

/// Reads a body of at most `limit` bytes into a buffer of exactly its declared length, at no
/// less than `rate`. Refuses (413) from the `Content-Length` header alone, before reading.
pub async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    rate: &BodyRate,
) -> Result<Vec<u8>, ServerError> {
    let declared = declared_length(headers, limit)?;
    let buf = Vec::with_capacity(declared as usize);
    read_frames(body, Some(declared), limit, rate, buf).await
}

/// Where a body's bytes go as they arrive: memory, or a file ([`spool_body`]).
trait Sink {
    /// Bytes taken so far.
    fn taken(&self) -> u64;
    async fn take(&mut self, data: &[u8]) -> Result<(), ServerError>;
}

impl Sink for Vec<u8> {
    fn taken(&self) -> u64 {
        self.len() as u64
    }

    async fn take(&mut self, data: &[u8]) -> Result<(), ServerError> {
        self.extend_from_slice(data);
        Ok(())
    }
}

/// A body written to an unnamed file as it arrives (through the runtime's blocking pool).
struct Spooling {
    file: tokio::io::BufWriter<tokio::fs::File>,
    taken: u64,
}

impl Sink for Spooling {
    fn taken(&self) -> u64 {
        self.taken
    }

    async fn take(&mut self, data: &[u8]) -> Result<(), ServerError> {
        use tokio::io::AsyncWriteExt;
        self.file
            .write_all(data)
            .await
            .map_err(|e| ServerError::internal(format!("spooling the body to disk: {e}")))?;
        self.taken += data.len() as u64;
        Ok(())
    }
}

/// Reads a body of at most `limit` bytes, at no less than `rate`, into an unnamed file in `dir`
/// (gone when the file is closed) rather than memory: what a model or module upload of any size
/// holds is a write buffer. Refuses (413) from the `Content-Length` header alone, before
/// reading. The file comes back whole and flushed, for a mapping.
pub async fn spool_body(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    rate: &BodyRate,
    dir: &std::path::Path,
) -> Result<std::fs::File, ServerError> {
    let declared = declared_length(headers, limit)?;
    let at = dir.to_path_buf();
    let file = crate::blocking(move || {
        tempfile::tempfile_in(&at).map_err(|e| {
            ServerError::internal(format!("creating a spool file in {}: {e}", at.display()))
        })
    })
    .await?;
    let sink = Spooling {
        file: tokio::io::BufWriter::with_capacity(1 << 20, tokio::fs::File::from_std(file)),
        taken: 0,
    };
    let mut spooled = read_frames(body, Some(declared), limit, rate, sink).await?;
    use tokio::io::AsyncWriteExt;
    spooled
        .file
        .flush()
        .await
        .map_err(|e| ServerError::internal(format!("spooling the body to disk: {e}")))?;
    Ok(spooled.file.into_inner().into_std().await)
}

/// Reads `body` into `sink` at no less than `rate`: exactly `declared` bytes when its length
/// was declared, else at most `limit` (413 past it).
async fn read_frames<S: Sink>(
    body: Body,
    declared: Option<u64>,
    limit: u64,
    rate: &BodyRate,
    mut sink: S,
) -> Result<S, ServerError> {
    let start = tokio::time::Instant::now();
    let mut body = body;
    let shown =
        |d: Option<u64>| d.map_or_else(|| "an undeclared number of".into(), |d| d.to_string());
    loop {
        let received = sink.taken();
        let frame = match tokio::time::timeout_at(rate.cutoff(start, received), body.frame()).await
        {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(_) => {
                let secs = start.elapsed().as_secs_f64();
                return Err(ServerError::Timeout {
                    code: ErrorCode::UploadTooSlow,
                    message: format!(
                        "the body arrived too slowly: {received} of {} bytes in {secs:.1} s, below the server's minimum of {} bytes/s; check the connection and retry",
                        shown(declared),
                        rate.min_bytes_per_sec
                    ),
                });
            }
        };
        let frame =
            frame.map_err(|e| ServerError::BadRequest(format!("reading the body failed: {e}")))?;
        if let Ok(data) = frame.into_data() {
            let len = sink.taken() + data.len() as u64;
            match declared {
                Some(d) if len > d => {
                    return Err(ServerError::BadRequest(
                        "body is longer than its Content-Length".into(),
                    ))
                }
                None if len > limit => {
                    return Err(ServerError::PayloadTooLarge {
                        got: len,
                        limit,
                        hint: "",
                    })
                }
                _ => {}
            }
            sink.take(&data).await?;
        }
    }
    if let Some(declared) = declared.filter(|d| sink.taken() != *d) {
        return Err(ServerError::BadRequest(format!(
            "body ended after {} of {declared} bytes",
            sink.taken()
        )));
    }
    Ok(sink)
}

/// Reads a small body (JSON) of at most `limit` bytes through its own byte budget (waited for at
/// most the body wait) and the rate floor uploads have. Its credentials were checked before this
/// is called; its length need not be declared (then `limit` is reserved).
pub async fn read_small(
    state: &Shared,
    headers: &HeaderMap,
    body: Body,
    limit: u64,
) -> Result<Vec<u8>, ServerError> {
    let declared = match headers.get(CONTENT_LENGTH) {
        Some(_) => Some(declared_length(headers, limit)?),
        None => None,
    };
    let _memory = state
        .json_budget
        .reserve_within(declared.unwrap_or(limit), state.limits.body_wait)
        .await?;
    let buf = Vec::with_capacity(declared.unwrap_or(0) as usize);
    read_frames(body, declared, limit, &state.limits.body_rate, buf).await
}

/// The declared `Content-Length`, checked against `limit`.
pub fn declared_length(headers: &HeaderMap, limit: u64) -> Result<u64, ServerError> {
    let declared: u64 = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .ok_or(ServerError::LengthRequired)?;
    if declared > limit {
        return Err(ServerError::PayloadTooLarge {
            got: declared,
            limit,
            hint: "",
        });
    }
    Ok(declared)
}

/// Bytes of upload bodies in memory at once, in KiB permits, of which one body reserves at most
/// a share; bodies larger than the share are read one at a time (see the module's doc).
pub struct IngestBudget {
    kib: Arc<Semaphore>,
    /// The most one body reserves.
    share_kib: u32,
    /// The turn of bodies larger than the share.
    large: Arc<Semaphore>,
}

/// A body's room in an [`IngestBudget`]: its reservation, and its turn if it is larger than the
/// share. Held while the body is in memory.
pub struct Reservation {
    _memory: OwnedSemaphorePermit,
    _turn: Option<OwnedSemaphorePermit>,
}

impl IngestBudget {
    /// A budget of `bytes`, of which one body reserves at most `share` (a fraction in (0, 1]).
    pub fn new(bytes: u64, share: f64) -> Self {
        let total_kib = bytes.div_ceil(1024).clamp(1, u64::from(u32::MAX >> 4)) as u32;
        let share_kib = (f64::from(total_kib) * share.clamp(0.0, 1.0)).floor() as u32;
        IngestBudget {
            kib: Arc::new(Semaphore::new(total_kib as usize)),
            share_kib: share_kib.clamp(1, total_kib),
            large: Arc::new(Semaphore::new(1)),
        }
    }

    /// Room for a body of `bytes` (the share for a body larger than it, once its turn comes),
    /// waiting at most `wait`: then 503 `busy`, to be retried later, rather than a request
    /// queued behind slow senders for as long as they take.
    async fn reserve_within(&self, bytes: u64, wait: Duration) -> Result<Reservation, ServerError> {
        let deadline = tokio::time::Instant::now() + wait;
        let kib = bytes.div_ceil(1024).max(1);
        let share = u64::from(self.share_kib);
        let turn = if kib > share {
            let turn = self.large.clone().acquire_owned();
            let turn = tokio::time::timeout_at(deadline, turn)
                .await
                .map_err(|_| busy_large(bytes, share * 1024, wait))?;
            Some(turn.map_err(ServerError::internal)?)
        } else {
            None
        };
        let room = self.kib.clone().acquire_many_owned(kib.min(share) as u32);
        let memory = tokio::time::timeout_at(deadline, room)
            .await
            .map_err(|_| busy_full(wait))?
            .map_err(ServerError::internal)?;
        Ok(Reservation {
            _memory: memory,
            _turn: turn,
        })
    }
}

fn busy_full(wait: Duration) -> ServerError {
    ServerError::unavailable(
        ErrorCode::Busy,
        format!(
            "the server is reading as many bodies as its memory budget allows and none made room within {} s; retry later",
            wait.as_secs()
        ),
    )
}

fn busy_large(bytes: u64, share: u64, wait: Duration) -> ServerError {
    ServerError::unavailable(
        ErrorCode::Busy,
        format!(
            "a body of {bytes} bytes is larger than one upload's share of the server's body budget ({share} bytes: --max-upload-share of --upload-buffer-bytes), and such bodies are read one at a time; another was still being read after {} s, so retry later",
            wait.as_secs()
        ),
    )
}

/// Which (task, client) pairs have an upload in flight.
#[derive(Default)]
pub struct UploadsInFlight(Mutex<HashSet<(String, String)>>);

/// One client's upload in flight; the pair is free again when this is dropped.
pub struct UploadGuard {
    owner: Arc<UploadsInFlight>,
    key: (String, String),
}

impl Drop for UploadGuard {
    fn drop(&mut self) {
        self.owner.0.lock().expect("uploads lock").remove(&self.key);
    }
}

impl UploadsInFlight {
    /// Marks `client`'s upload to `task` in flight, or refuses a second one.
    pub fn begin(self: &Arc<Self>, task: &str, client: &str) -> Result<UploadGuard, ServerError> {
        let key = (task.to_string(), client.to_string());
        if !self.0.lock().expect("uploads lock").insert(key.clone()) {
            return Err(ServerError::conflict(
                ErrorCode::UploadInProgress,
                format!("client `{client}` already has an upload to task `{task}` in flight: wait for its answer"),
            ));
        }
        Ok(UploadGuard {
            owner: self.clone(),
            key,
        })
    }
}

/// What an upload holds while it is read and folded: its place in the byte budget and an
/// ingest slot. The slot goes once the update is open (the fold may wait for its round's lock,
/// and uploads to other tasks need the slot meanwhile), the rest once the update is folded,
/// before the wait for durability.
pub struct IngestPermit {
    _memory: Reservation,
    slot: Option<OwnedSemaphorePermit>,
}

impl crate::round::Ingest for IngestPermit {
    fn opened(&mut self) {
        self.slot = None;
    }
}

/// Reads an upload body of at most `limit` bytes under the byte budget, then takes one of the
/// ingest slots (so a slow body never holds one). The body must arrive within `within` (its
/// round's deadline) as well as above the configured floor; room in the budget (and a body
/// larger than one upload's share, its turn) is waited for at most the configured body wait
/// (then 503 `busy`, and the client retries).
pub async fn read_upload(
    state: &Shared,
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    within: Duration,
) -> Result<(Vec<u8>, IngestPermit), ServerError> {
    let declared = declared_length(headers, limit)?;
    let memory = state
        .budget
        .reserve_within(declared, state.limits.body_wait)
        .await?;
    let rate = state.limits.body_rate.within(declared, within);
    let bytes = read_body(headers, body, limit, &rate).await?;
    let slot = state
        .ingest
        .clone()
        .acquire_owned()
        .await
        .map_err(ServerError::internal)?;
    Ok((
        bytes,
        IngestPermit {
            _memory: memory,
            slot: Some(slot),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_body_must_arrive_within_its_deadline() {
        let floor = BodyRate::default();
        // Small bodies keep the configured floor.
        assert_eq!(
            floor
                .within(1 << 20, Duration::from_secs(600))
                .min_bytes_per_sec,
            16 << 10
        );
        // 200 MB due in 600 s: at least 333,334 bytes/s.
        assert_eq!(
            floor
                .within(200_000_000, Duration::from_secs(600))
                .min_bytes_per_sec,
            333_334
        );
    }

    #[test]
    fn the_cutoff_grows_with_what_arrived() {
        let rate = BodyRate {
            min_bytes_per_sec: 1000,
            grace: Duration::from_secs(2),
        };
        let start = tokio::time::Instant::now();
        assert_eq!(
            rate.cutoff(start, 0) - start,
            Duration::from_secs(2) + Duration::from_millis(1)
        );
        assert_eq!(rate.cutoff(start, 4999) - start, Duration::from_secs(7));
    }

    #[tokio::test]
    async fn a_second_upload_of_the_same_client_is_refused_until_the_first_ends() {
        let uploads = Arc::new(UploadsInFlight::default());
        let first = uploads.begin("t", "c").unwrap();
        let err = uploads.begin("t", "c").err().unwrap();
        assert_eq!(err.code(), ErrorCode::UploadInProgress);
        let _other_task = uploads.begin("u", "c").unwrap();
        drop(first);
        assert!(uploads.begin("t", "c").is_ok());
    }

    const WAIT: Duration = Duration::from_millis(50);

    #[tokio::test]
    async fn one_body_reserves_at_most_its_share_and_larger_ones_take_turns() {
        // 16 KiB, a quarter of it per body.
        let budget = IngestBudget::new(16 << 10, 0.25);
        // A body larger than the whole budget holds its turn and a quarter of the budget...
        let huge = budget.reserve_within(1 << 30, WAIT).await.unwrap();
        // ...so bodies up to the share keep the other three quarters.
        let small: Vec<_> = reserve_all(&budget, &[4 << 10, 4 << 10, 4 << 10]).await;
        let err = budget.reserve_within(1, WAIT).await.err().unwrap();
        assert_eq!(err.code(), ErrorCode::Busy);
        drop(small);
        // Another large body waits for its turn, not for the budget, and is told so.
        let err = budget.reserve_within(5 << 10, WAIT).await.err().unwrap();
        assert_eq!(err.code(), ErrorCode::Busy);
        assert!(err.to_string().contains("one at a time"), "{err}");
        drop(huge);
        let _next = budget.reserve_within(5 << 10, WAIT).await.unwrap();
    }

    #[tokio::test]
    async fn a_large_body_waiting_for_its_turn_does_not_hold_up_smaller_ones() {
        let budget = Arc::new(IngestBudget::new(16 << 10, 0.25));
        let first = budget.reserve_within(1 << 20, WAIT).await.unwrap();
        // A second large body waits (up to a long body wait) for the first one's turn...
        let waiting = {
            let budget = budget.clone();
            tokio::spawn(async move {
                budget
                    .reserve_within(1 << 20, Duration::from_secs(10))
                    .await
                    .map(drop)
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        // ...while smaller ones come and go at once.
        for _ in 0..3 {
            let _small = budget.reserve_within(4 << 10, WAIT).await.unwrap();
        }
        drop(first);
        waiting.await.unwrap().unwrap();
    }

    /// Reserves each of `sizes` (in bytes), all held together.
    async fn reserve_all(budget: &IngestBudget, sizes: &[u64]) -> Vec<Reservation> {
        let mut held = Vec::new();
        for &bytes in sizes {
            held.push(budget.reserve_within(bytes, WAIT).await.unwrap());
        }
        held
    }
}
