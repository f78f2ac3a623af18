//! Central differential privacy on the plain (sealed-upload) path.
//!
//! **What is guaranteed.** With `differential_privacy` set on a task, the sequence of global
//! models the task publishes is (ε, δ)-differentially private with respect to adding or removing
//! *one client's entire contribution* (user-level DP, add/remove adjacency): whatever one client
//! sent, in every round it took part in, changes the distribution of the published models by at
//! most the reported ε and δ. The round history reports ε after every round
//! ([`PrivacySpent`]), `/metrics` exposes it as `hora_dp_epsilon{task}`, and a task with an
//! `epsilon_budget` finishes before it publishes a round that would take ε above the budget.
//!
//! **The mechanism** is DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018) with a trusted server:
//! 1. Each update is clipped to L2 norm `C` and folded with weight 1 ([`clip`]): one client moves
//!    the round's sum by at most `C`.
//! 2. When the round closes, Gaussian noise of standard deviation `z·C` (`z`: the noise
//!    multiplier) is added once to every coordinate of the sum ([`noise`]), before the strategy
//!    turns the sum into the next model.
//! 3. The sum is divided by the *expected* number of updates, `target_clients`, not by the number
//!    that arrived: the published model is then a function of the noised sum and of public
//!    settings alone (post-processing keeps the guarantee), while dividing by the actual count
//!    would release a count that one client changes by 1. A round closed at its deadline with
//!    fewer updates moves the model proportionally less.
//! 4. The round is accounted as one run of the sampled Gaussian mechanism ([`accountant`]) with
//!    sampling rate `q` and multiplier `z`; ε at `delta` follows from the running RDP totals.
//!    With adaptive clipping, the noised count that steers `C` is part of the same budget.
//!
//! **The sampling rate and its assumption.** The server accounts each round with
//! `q = clients selected for the round / clients eligible for the task` (enrolled, not revoked,
//! and not bound by their enrolment to other tasks), counted when the round closes. The
//! amplification by subsampling behind small ε (Mironov, Talwar, Zhang 2019) holds when every
//! eligible client is in a round independently with probability `q`. The server selects the
//! first clients to join a round, so the guarantee means what it says only if *who* joins first
//! is independent of the clients' data: clients poll at jittered times and every eligible client
//! is online and willing in every round. A fleet where the same few devices always win the race,
//! or where availability depends on the data, gets less privacy than reported; if in doubt,
//! account as if `q = 1` by enrolling only the clients that take part.
//!
//! **What is not protected.** The server is trusted: it sees every decrypted update before
//! noise (central, not local, DP). The admin API's round history (participants, example counts,
//! reported metrics) is operator information and carries no DP guarantee; only the models are
//! private. Central DP needs the plain path: a secure-aggregation round sums masked vectors the
//! server cannot clip, so the two cannot be combined yet.
//!
//! **Retries.** A close that fails (storage trouble) is retried; the noise goes into the sum the
//! first time and the accumulator remembers it (in its checkpoints too), so a retried close
//! publishes the same noised sum — never an un-noised one, never noise twice. The accountant's
//! totals live in the task record and advance in the same transaction that publishes the round,
//! so a restart continues counting from the last published round. (The noise on the count that
//! steers an adaptive clip is drawn again by a retried close; only the published draw ever
//! leaves the server.)

pub mod accountant;
pub mod clip;
pub mod noise;
