//! The whole protocol in one process — n [`ClientSession`]s and the server's [`Unmasker`], with
//! clients vanishing after a chosen stage — for tests of this and dependent crates.

use std::collections::BTreeSet;

use super::unmask::Participant;
use super::*;
use crate::wire::{SecAggNeighbour, SecAggRoster, SecAggSealedShares, SecAggShareBundles};

/// What an attempt produced.
pub struct Outcome {
    /// The unmasked sum of the survivors' inputs, as the server computes it.
    pub sum: Vec<u32>,
    /// The same sum computed in the clear.
    pub expected: Vec<u32>,
    /// The first masked input the server received, exactly as it arrived.
    pub first_upload: Vec<u32>,
    /// Every masked input the server received, in the order of `survivors`.
    pub uploads: Vec<Vec<u32>>,
    /// Clients whose input is in the sum.
    pub survivors: Vec<usize>,
}

/// Runs one attempt over `inputs` (one vector per client, all the same length);
/// `drop_after[i] = Some(stage)` makes client i vanish once it has completed `stage`.
pub fn run(inputs: &[Vec<u32>], drop_after: &[Option<Stage>]) -> Result<Outcome, SecAggError> {
    let n = inputs.len();
    let m = inputs.first().map_or(0, Vec::len);
    let ctx = Context::new("task", 1, 0);
    let ids: Vec<String> = (0..n).map(|i| format!("c{i:04}")).collect();
    let identities: Vec<Identity> = (0..n)
        .map(|_| Identity::generate().map(|(i, _)| i))
        .collect::<Result<_, _>>()?;
    let mut sessions: Vec<ClientSession> = ids
        .iter()
        .map(|id| ClientSession::new(ctx.clone(), id))
        .collect::<Result<_, _>>()?;
    let adverts: Vec<_> = sessions
        .iter()
        .zip(&identities)
        .map(|(s, i)| s.advertise(i))
        .collect();
    let alive = |i: usize, after: Stage| {
        drop_after
            .get(i)
            .copied()
            .flatten()
            .is_none_or(|d| d > after)
    };
    let position = |id: &str| ids.iter().position(|x| x == id);
    let k = graph::default_degree(n);
    let t = graph::default_threshold(k);
    let graph = graph::neighbours(n, k, &[42; 32]);
    let participants: Vec<Participant> = (0..n)
        .map(|i| {
            Ok(Participant {
                id: ids[i].clone(),
                index: i as u32 + 1,
                mask_key: hex_array("mask_key", &adverts[i].mask_key)?,
                neighbours: graph[i].clone(),
            })
        })
        .collect::<Result<_, SecAggError>>()?;
    // Stage 1: share keys.
    let mut mail: Vec<Vec<SecAggSealedShares>> = vec![Vec::new(); n];
    let mut shared = BTreeSet::new();
    for i in (0..n).filter(|&i| alive(i, Stage::Advertised)) {
        let roster = SecAggRoster {
            index: i as u32 + 1,
            threshold: t as u32,
            input_deadline_unix_ms: 0,
            neighbours: graph[i]
                .iter()
                .map(|&j| SecAggNeighbour {
                    client: ids[j].clone(),
                    index: j as u32 + 1,
                    identity_key: hex::encode(identities[j].public_key()),
                    keys: adverts[j].clone(),
                })
                .collect(),
        };
        for bundle in sessions[i].share_keys(&roster)?.shares {
            if let Some(to) = position(&bundle.peer) {
                mail[to].push(SecAggSealedShares {
                    peer: ids[i].clone(),
                    ciphertext: bundle.ciphertext,
                });
            }
        }
        shared.insert(i);
    }
    // Stage 2: masked inputs, summed as they arrive.
    let mut sum = vec![0u32; m];
    let mut expected = vec![0u32; m];
    let mut uploads = Vec::new();
    let mut survivors = BTreeSet::new();
    for i in shared
        .iter()
        .copied()
        .filter(|&i| alive(i, Stage::SharedKeys))
    {
        let inbox = SecAggShareBundles {
            shares: mail[i]
                .iter()
                .filter(|s| position(&s.peer).is_some_and(|p| shared.contains(&p)))
                .cloned()
                .collect(),
        };
        let y = sessions[i].masked_input(&inbox, &inputs[i])?;
        sum.iter_mut()
            .zip(&y)
            .for_each(|(s, v)| *s = s.wrapping_add(*v));
        uploads.push(y);
        expected
            .iter_mut()
            .zip(&inputs[i])
            .for_each(|(s, v)| *s = s.wrapping_add(*v));
        survivors.insert(i);
    }
    // Stage 3: unmask.
    let mut unmasker = Unmasker::new(ctx, &participants, t, shared, survivors.clone());
    for i in survivors
        .iter()
        .copied()
        .filter(|&i| alive(i, Stage::MaskedInput))
    {
        let answer = sessions[i].unmask(&unmasker.request_for(i))?;
        unmasker.accept(i, &answer)?;
    }
    unmasker.finish(&mut sum)?;
    Ok(Outcome {
        sum,
        expected,
        first_upload: uploads.first().cloned().unwrap_or_default(),
        uploads,
        survivors: survivors.into_iter().collect(),
    })
}

#[cfg(test)]
mod tests {
    use rand_chacha::rand_core::SeedableRng;

    use super::*;

    fn inputs(n: usize, m: usize) -> Vec<Vec<u32>> {
        let q = Quantiser::for_round(1.0, 100, n).unwrap();
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(3);
        (0..n)
            .map(|c| {
                let delta: Vec<f32> = (0..m - 1)
                    .map(|i| ((c + i) as f32 * 0.1).cos() * 0.5)
                    .collect();
                q.encode(&delta, 10 + c as u64, &mut rng)
            })
            .collect()
    }

    #[test]
    fn the_sum_of_the_survivors_comes_out_with_dropouts_at_every_stage() {
        let n = 20;
        let inputs = inputs(n, 1001);
        for drops in [
            vec![],
            vec![(3, Stage::Advertised), (11, Stage::SharedKeys)],
            vec![
                (0, Stage::Advertised),
                (5, Stage::Advertised),
                (7, Stage::SharedKeys),
                (8, Stage::SharedKeys),
                (13, Stage::MaskedInput),
                (19, Stage::MaskedInput),
            ],
        ] {
            let mut drop_after = vec![None; n];
            for (i, s) in &drops {
                drop_after[*i] = Some(*s);
            }
            let out = run(&inputs, &drop_after).unwrap();
            assert_eq!(out.sum, out.expected, "dropouts {drops:?}");
            let gone_early = drops
                .iter()
                .filter(|(_, s)| *s < Stage::MaskedInput)
                .count();
            assert_eq!(out.survivors.len(), n - gone_early);
        }
    }

    #[test]
    fn too_many_dropouts_leave_secrets_unrecoverable() {
        let n = 6; // k = 5 (everyone), t = 3
        let inputs = inputs(n, 11);
        let mut drop_after = vec![None; n];
        for i in [1, 2, 3] {
            drop_after[i] = Some(Stage::SharedKeys);
        }
        let err = run(&inputs, &drop_after).err().expect("must fail");
        assert!(matches!(err, SecAggError::Threshold(_)), "{err}");
    }
}
