//! hora-client: the Hora client SDK.
//!
//! A client downloads its task's global model, trains on data that never leaves it with tch
//! (libtorch), seals `local − global` to the round key (hora-common's envelope) and uploads it.
//! The same crate runs datacenter workers in the synchronous allreduce mode.
//!
//! Today it holds [`device`], the one place a user's device choice becomes a tch device; the
//! SDK (`Client`, `Trainer`), the edge binary and the allreduce worker arrive with their issues.

pub mod device;
