//! Devices as a simulated federation sees them: how fast each virtual client trains, how fast
//! its network is, when it is online and how often it drops out — drawn once per client from a
//! [`Profile`] and the seed, so the same client is the same device in every round and run.
//!
//! A round's time for one client, in simulated seconds, is what the field would show: download
//! the global model, train `examples × epochs` samples, upload the update.

use std::path::Path;
use std::str::FromStr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha12Rng;

use hora_common::simulation::client_seed;

/// One client's device and network.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Device {
    /// Training samples per second (one sample through forward and backward).
    pub samples_per_s: f64,
    /// Download and upload bandwidth, bytes per second.
    pub down_bytes_per_s: f64,
    pub up_bytes_per_s: f64,
    /// One-way latency of a request, seconds.
    pub latency_s: f64,
    /// Online for this fraction of every day (1: always), from `online_from_s` into it.
    pub online_fraction: f64,
    pub online_from_s: f64,
    /// The chance that the client drops out of a round it was selected for.
    pub dropout: f64,
}

/// Seconds in the simulated day over which availability windows repeat.
pub const DAY_S: f64 = 86_400.0;

impl Device {
    /// Simulated seconds for a round: download `model_bytes`, train `samples`, upload
    /// `update_bytes`.
    pub fn round_seconds(&self, model_bytes: u64, samples: u64, update_bytes: u64) -> f64 {
        2.0 * self.latency_s
            + model_bytes as f64 / self.down_bytes_per_s
            + samples as f64 / self.samples_per_s
            + 2.0 * self.latency_s
            + update_bytes as f64 / self.up_bytes_per_s
    }

    /// Whether the client is online at simulated time `t_s`.
    pub fn online_at(&self, t_s: f64) -> bool {
        if self.online_fraction >= 1.0 {
            return true;
        }
        let into = (t_s - self.online_from_s).rem_euclid(DAY_S);
        into < self.online_fraction * DAY_S
    }
}

/// Where devices are drawn from.
#[derive(Debug, Clone, PartialEq)]
pub enum Profile {
    /// Every client the same device (`speed` samples/s, `mbps` both ways, no latency, always
    /// online, never dropping out): simulated time then only counts work.
    Uniform { speed: f64, mbps: f64 },
    /// A fleet of phones and laptops as measured in the field: speeds spread log-normally over
    /// two orders of magnitude, bandwidths over one, latency 20–200 ms, online 30–100% of the
    /// day, and `dropout` (default 0.05) of selected clients dropping out.
    Heterogeneous { dropout: f64 },
    /// Measured devices, one per row of a CSV file (`samples_per_s,down_mbps,up_mbps,latency_ms`
    /// and optionally `online_fraction,dropout`); client `k` gets row `k mod rows`.
    Trace(Vec<Device>),
}

impl Default for Profile {
    fn default() -> Self {
        Profile::Uniform {
            speed: 1_000.0,
            mbps: 100.0,
        }
    }
}

impl Profile {
    /// Client `client`'s device under `seed`.
    pub fn device(&self, seed: u64, client: u64) -> Device {
        match self {
            Profile::Uniform { speed, mbps } => Device {
                samples_per_s: *speed,
                down_bytes_per_s: mbps * 125_000.0,
                up_bytes_per_s: mbps * 125_000.0,
                latency_s: 0.0,
                online_fraction: 1.0,
                online_from_s: 0.0,
                dropout: 0.0,
            },
            Profile::Heterogeneous { dropout } => {
                // (u64::MAX as the round: a stream no client's training draws from.)
                let mut rng = ChaCha12Rng::seed_from_u64(client_seed(seed, client, u64::MAX));
                // exp(N(μ, σ)) by Box–Muller from two uniforms.
                let mut log_normal = |median: f64, sigma: f64| {
                    let (u1, u2): (f64, f64) = (rng.random_range(1e-12..1.0), rng.random());
                    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                    median * (sigma * z).exp()
                };
                let samples_per_s = log_normal(500.0, 1.0).clamp(20.0, 20_000.0);
                let down_mbps = log_normal(20.0, 0.8).clamp(1.0, 500.0);
                let up_mbps = (down_mbps * log_normal(0.3, 0.3)).clamp(0.5, 200.0);
                let latency_s = log_normal(0.06, 0.5).clamp(0.02, 0.2);
                let mut rng = ChaCha12Rng::seed_from_u64(client_seed(seed, client, u64::MAX - 1));
                Device {
                    samples_per_s,
                    down_bytes_per_s: down_mbps * 125_000.0,
                    up_bytes_per_s: up_mbps * 125_000.0,
                    latency_s,
                    online_fraction: rng.random_range(0.3..=1.0),
                    online_from_s: rng.random_range(0.0..DAY_S),
                    dropout: *dropout,
                }
            }
            Profile::Trace(rows) => {
                // (A trace gives each device's share of the day online; where in the day it
                // starts is drawn per client, so the fleet is not offline all at once.)
                let mut rng = ChaCha12Rng::seed_from_u64(client_seed(seed, client, u64::MAX - 1));
                Device {
                    online_from_s: rng.random_range(0.0..DAY_S),
                    ..rows[(client % rows.len() as u64) as usize]
                }
            }
        }
    }

    /// Reads a CSV trace of measured devices (a header line, then one device a row).
    pub fn read_trace(path: &Path) -> Result<Profile, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading the device trace {}: {e}", path.display()))?;
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        let (_, header) = lines
            .next()
            .ok_or_else(|| format!("{}: the device trace is empty", path.display()))?;
        let columns: Vec<&str> = header.split(',').map(str::trim).collect();
        let known = [
            "samples_per_s",
            "down_mbps",
            "up_mbps",
            "latency_ms",
            "online_fraction",
            "dropout",
        ];
        if columns.len() < 4 || columns[..] != known[..columns.len().min(6)] {
            return Err(format!(
                "{}: the header must be `{}` (the last two optional), not `{header}`",
                path.display(),
                known.join(",")
            ));
        }
        let mut rows = Vec::new();
        for (i, line) in lines {
            let at = |m: String| format!("{}: line {}: {m}", path.display(), i + 1);
            let values = line
                .split(',')
                .map(|v| v.trim().parse::<f64>())
                .collect::<Result<Vec<f64>, _>>()
                .map_err(|e| at(format!("{e}: every value is a number")))?;
            if values.len() != columns.len() {
                return Err(at(format!(
                    "{} values for {} columns",
                    values.len(),
                    columns.len()
                )));
            }
            let value = |k: usize, default: f64| values.get(k).copied().unwrap_or(default);
            let device = Device {
                samples_per_s: value(0, 0.0),
                down_bytes_per_s: value(1, 0.0) * 125_000.0,
                up_bytes_per_s: value(2, 0.0) * 125_000.0,
                latency_s: value(3, 0.0) / 1_000.0,
                online_fraction: value(4, 1.0),
                online_from_s: 0.0,
                dropout: value(5, 0.0),
            };
            let positive = [
                device.samples_per_s,
                device.down_bytes_per_s,
                device.up_bytes_per_s,
            ];
            let sound = positive.iter().all(|v| v.is_finite() && *v > 0.0)
                && device.latency_s.is_finite()
                && device.latency_s >= 0.0
                && device.online_fraction > 0.0
                && device.online_fraction <= 1.0
                && (0.0..1.0).contains(&device.dropout);
            if !sound {
                return Err(at("speeds and bandwidths must be above 0, latency at least 0, online_fraction in (0, 1] and dropout in [0, 1)".into()));
            }
            rows.push(device);
        }
        if rows.is_empty() {
            return Err(format!("{}: the device trace has no rows", path.display()));
        }
        Ok(Profile::Trace(rows))
    }
}

impl FromStr for Profile {
    type Err = String;

    /// `uniform`, `uniform:speed=1000,mbps=100`, `heterogeneous`, `heterogeneous:dropout=0.1`,
    /// or `trace:FILE.csv`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, params) = s.split_once(':').unwrap_or((s, ""));
        if kind == "trace" {
            return Profile::read_trace(Path::new(params));
        }
        let mut profile = match kind {
            "uniform" => Profile::default(),
            "heterogeneous" => Profile::Heterogeneous { dropout: 0.05 },
            _ => {
                return Err(format!(
                "unknown device profile `{s}`: use uniform[:speed=S,mbps=M], heterogeneous[:dropout=P] or trace:FILE.csv"
            ))
            }
        };
        for pair in params.split(',').filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("`{pair}` in `{s}` is not key=value"))?;
            let value: f64 = value
                .parse()
                .map_err(|_| format!("`{key}` in `{s}` must be a number"))?;
            match (&mut profile, key) {
                (Profile::Uniform { speed, .. }, "speed") if value > 0.0 => *speed = value,
                (Profile::Uniform { mbps, .. }, "mbps") if value > 0.0 => *mbps = value,
                (Profile::Heterogeneous { dropout }, "dropout") if (0.0..1.0).contains(&value) => {
                    *dropout = value
                }
                _ => {
                    return Err(format!(
                        "`{pair}` does not fit `{kind}`: uniform takes speed and mbps (above 0), heterogeneous takes dropout (in [0, 1))"
                    ))
                }
            }
        }
        Ok(profile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_is_the_same_device_every_time_and_the_fleet_is_spread() {
        let profile: Profile = "heterogeneous:dropout=0.1".parse().unwrap();
        assert_eq!(profile.device(3, 17), profile.device(3, 17));
        assert_ne!(profile.device(3, 17), profile.device(3, 18));
        assert_ne!(profile.device(3, 17), profile.device(4, 17));
        let speeds: Vec<f64> = (0..2_000)
            .map(|c| profile.device(1, c).samples_per_s)
            .collect();
        let mut sorted = speeds.clone();
        sorted.sort_by(f64::total_cmp);
        // A log-normal with σ = 1 about 500: the median near 500, the deciles a factor of
        // e^1.28 ≈ 3.6 either side.
        let median = sorted[1_000];
        assert!((400.0..625.0).contains(&median), "median {median}");
        let spread = sorted[1_800] / sorted[200];
        assert!((8.0..20.0).contains(&spread), "decile ratio {spread}");
        assert!(sorted.iter().all(|s| (20.0..=20_000.0).contains(s)));
    }

    #[test]
    fn round_time_adds_transfers_and_training_and_availability_repeats_daily() {
        let device = Device {
            samples_per_s: 100.0,
            down_bytes_per_s: 1_000.0,
            up_bytes_per_s: 500.0,
            latency_s: 0.25,
            online_fraction: 0.5,
            online_from_s: 3_600.0,
            dropout: 0.0,
        };
        // 4 × 0.25 s of latency, 2 s down, 3 s of training, 2 s up.
        assert!((device.round_seconds(2_000, 300, 1_000) - 8.0).abs() < 1e-12);
        assert!(!device.online_at(0.0));
        assert!(device.online_at(3_600.0));
        assert!(device.online_at(3_600.0 + DAY_S * 0.49));
        assert!(!device.online_at(3_600.0 + DAY_S * 0.51));
        assert!(device.online_at(3_600.0 + 3.0 * DAY_S + 1.0));
    }

    #[test]
    fn traces_are_read_and_bad_ones_say_where() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet.csv");
        std::fs::write(
            &path,
            "samples_per_s,down_mbps,up_mbps,latency_ms\n100,8,2,50\n2000,80,20,10\n",
        )
        .unwrap();
        let profile: Profile = format!("trace:{}", path.display()).parse().unwrap();
        assert_eq!(profile.device(0, 3).samples_per_s, 2_000.0);
        assert_eq!(profile.device(0, 4).up_bytes_per_s, 250_000.0);
        std::fs::write(
            &path,
            "samples_per_s,down_mbps,up_mbps,latency_ms\n100,8,0,50\n",
        )
        .unwrap();
        let e = Profile::read_trace(&path).unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        assert!("uniform:speed=0".parse::<Profile>().is_err());
        assert!("phones".parse::<Profile>().is_err());
    }
}
