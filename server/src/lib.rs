//! hora-server: the Hora aggregation server.
//!
//! It hands out the current global model of each federated task over HTTPS, takes sealed weight
//! deltas from clients, folds each into its round's running weighted sum the moment it arrives
//! (hora-common's kernel; memory O(model), never O(clients × model)), keeps its state in sled with
//! large blobs in content-addressed files, and is driven by operators through a REST admin API.
//!
//! The server never links libtorch: everything it computes goes through `hora_common`'s CPU
//! kernel. The HTTP service, store, rounds and admin API arrive with the server issue; this crate
//! is the place they live.
