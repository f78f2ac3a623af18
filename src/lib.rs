//! Hora umbrella package.
