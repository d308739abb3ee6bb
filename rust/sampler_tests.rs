use super::*;

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams { seed: Some(7), ..Default::default() };
    f(&mut p);
    p
}

fn ln(ps: &[f64]) -> Vec<f32> {
    ps.iter().map(|p| p.ln() as f32).collect()
}

fn kept(logits: &[f32], top_k: usize, top_p: f32) -> Vec<u32> {
    candidates(logits, 1.0, top_k, top_p).into_iter().map(|c| c.0).collect()
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    let l = ln(&[0.1, 0.2, 0.5, 0.2]); // sorted: id 2 (0.5), ids 1 and 3 tie at 0.2 (lower id first), id 0
    assert_eq!(kept(&l, 0, 0.3), vec![2]);
    assert_eq!(kept(&l, 0, 0.5), vec![2]);
    assert_eq!(kept(&l, 0, 0.55), vec![2, 1]);
    assert_eq!(kept(&l, 0, 0.65), vec![2, 1]);
    assert_eq!(kept(&l, 0, 0.75), vec![2, 1, 3]);
    assert_eq!(kept(&l, 0, 0.95), vec![2, 1, 3, 0]);
    assert_eq!(kept(&l, 0, 1.0), vec![2, 1, 3, 0]);
    assert_eq!(kept(&l, 0, 0.0), vec![2]);
    // top-k first, then top-p over the renormalised rest: {2, 1} -> 0.714, 0.286.
    assert_eq!(kept(&l, 2, 0.7), vec![2]);
    assert_eq!(kept(&l, 2, 0.72), vec![2, 1]);
}

#[test]
fn temperature_zero_is_argmax_with_lowest_id_on_ties() {
    let mut s = Sampler::new(params(|p| p.temperature = 0.0), &[], 5, 4);
    assert_eq!(s.sample(&mut [0.0, 3.0, 1.0, 3.0, -1.0]), 1);
}

#[test]
fn argmax_takes_the_first_of_equal_maxima_across_lanes_and_tail_and_skips_nan() {
    let mut l = vec![0.5f32; 50];
    l[0] = f32::NAN;
    assert_eq!(argmax(&l), 1); // every finite value equal: the first one
    l[40] = 2.0;
    l[7] = 2.0;
    assert_eq!(argmax(&l), 7); // different 16-lane slots, first index wins
    l[49] = 3.0; // in the tail past the last full chunk of 16
    assert_eq!(argmax(&l), 49);
    assert_eq!(argmax(&[f32::NAN; 20]), 0);
    assert_eq!(argmax(&[f32::NEG_INFINITY, 1.0, f32::INFINITY, f32::INFINITY]), 2);
    assert_eq!(argmax(&[]), 0);
}

#[test]
fn seed_reproduces_and_seeds_differ() {
    let logits = vec![0.0f32; 1000];
    let draw = |seed: u64| {
        let mut s = Sampler::new(params(|p| p.seed = Some(seed)), &[], 1000, 999);
        (0..50).map(|_| s.sample(&mut logits.clone())).collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
}

#[test]
fn penalties_follow_the_formulas_exactly() {
    let p = params(|p| {
        p.repetition_penalty = 2.0;
        p.presence_penalty = 0.5;
        p.frequency_penalty = 0.25;
    });
    let mut s = Sampler::new(p, &[0, 1], 6, 5);
    s.accept(2);
    s.accept(2);
    s.accept(3);
    let mut l = vec![4.0, -4.0, 4.0, -1.0, 4.0, 0.0];
    s.process(&mut l);
    // id 0: prompt, positive -> /2; id 1: prompt, negative -> *2; id 2: generated twice -> /2 then -0.5 - 2*0.25;
    // id 3: generated once, negative -> *2 then -0.5 - 0.25; id 4: untouched.
    assert_eq!(l, vec![2.0, -8.0, 2.0 - 1.0, -2.0 - 0.75, 4.0, 0.0]);
}

#[test]
fn min_tokens_and_ignore_eos_mask_stops() {
    let mut s = Sampler::new(
        params(|p| {
            p.min_tokens = 1;
            p.stop_token_ids = vec![2];
        }),
        &[],
        4,
        3,
    );
    let mut l = vec![0.0, 0.0, 9.0, 9.0];
    s.process(&mut l);
    assert_eq!(l, vec![0.0, 0.0, f32::NEG_INFINITY, f32::NEG_INFINITY]);
    s.accept(0);
    let mut l = vec![0.0, 0.0, 9.0, 9.0];
    s.process(&mut l);
    assert_eq!(l, vec![0.0, 0.0, 9.0, 9.0]);
    assert!(s.is_stop(2) && s.is_stop(3) && !s.is_stop(1));

    let s = Sampler::new(params(|p| p.ignore_eos = true), &[], 4, 3);
    let mut l = vec![0.0, 0.0, 9.0, 9.0];
    s.process(&mut l);
    assert_eq!(l[3], f32::NEG_INFINITY);
    assert!(!s.is_stop(3));
}

#[test]
fn top_k_draws_only_the_k_best() {
    let mut s = Sampler::new(params(|p| p.top_k = 2), &[], 5, 4);
    for _ in 0..500 {
        let t = s.sample(&mut [1.0, 5.0, 2.0, 4.9, 0.0]);
        assert!(t == 1 || t == 3, "drew {t}");
    }
}

/// Pearson chi-square of draws against softmax(logits / T).
fn chi_square(logits: &[f32], t: f32, top_p: f32, draws: usize) -> f64 {
    let mut s = Sampler::new(
        params(|p| {
            p.temperature = t;
            p.top_p = top_p;
            p.seed = Some(12345);
        }),
        &[],
        logits.len(),
        logits.len() as u32 + 1,
    );
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..draws {
        counts[s.sample(&mut logits.to_vec()) as usize] += 1;
    }
    let expected: Vec<f64> = candidates(logits, t, 0, top_p).iter().map(|c| c.1).collect();
    let ids: Vec<u32> = candidates(logits, t, 0, top_p).iter().map(|c| c.0).collect();
    let total: f64 = expected.iter().sum();
    let mut chi = 0.0;
    for (id, e) in ids.iter().zip(&expected) {
        let e = e / total * draws as f64;
        chi += (counts[*id as usize] as f64 - e).powi(2) / e;
    }
    let outside: usize = (0..logits.len()).filter(|i| !ids.contains(&(*i as u32))).map(|i| counts[i]).sum();
    assert_eq!(outside, 0, "drew tokens outside the kept set");
    chi
}

#[test]
fn sampling_frequencies_match_softmax() {
    let logits = vec![1.0, 2.0, 0.5, -1.0, 1.5, 0.0];
    // df = 5; the 0.999 quantile of chi-square(5) is 20.52.
    assert!(chi_square(&logits, 0.7, 1.0, 60_000) < 20.52);
    assert!(chi_square(&logits, 1.3, 1.0, 60_000) < 20.52);
    // With top_p = 0.8 at T = 1 the kept set is {1, 4, 0} (0.80 of the mass): df = 2, 0.999 quantile 13.82.
    assert!(chi_square(&logits, 1.0, 0.8, 60_000) < 13.82);
}

#[test]
fn chi_square_detects_a_wrong_temperature() {
    // The statistic has power: draws at T = 0.7 judged against T = 1.0 fail clearly.
    let logits = vec![1.0f32, 2.0, 0.5, -1.0, 1.5, 0.0];
    let mut s = Sampler::new(params(|p| p.temperature = 0.7), &[], 6, 7);
    let mut counts = [0f64; 6];
    for _ in 0..60_000 {
        counts[s.sample(&mut logits.clone()) as usize] += 1.0;
    }
    let z: f64 = logits.iter().map(|l| (*l as f64).exp()).sum();
    let chi: f64 = logits
        .iter()
        .zip(counts)
        .map(|(l, c)| {
            let e = (*l as f64).exp() / z * 60_000.0;
            (c - e).powi(2) / e
        })
        .sum();
    assert!(chi > 100.0, "chi {chi}");
}

#[test]
fn invalid_params_are_rejected() {
    assert!(params(|p| p.temperature = -1.0).validate().is_err());
    assert!(params(|p| p.top_p = 1.5).validate().is_err());
    assert!(params(|p| p.max_tokens = 0).validate().is_err());
    assert!(params(|p| {
        p.min_tokens = 5;
        p.max_tokens = 2;
    })
    .validate()
    .is_err());
}
