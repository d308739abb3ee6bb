use super::*;

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams { seed: Some(7), ..Default::default() };
    f(&mut p);
    p
}

fn ln(ps: &[f64]) -> Vec<f32> {
    ps.iter().map(|p| p.ln() as f32).collect()
}

/// The kept tokens with normalised probabilities, in descending probability (ties: lower id first).
fn kept_probs(logits: &[f32], t: f32, top_k: usize, top_p: f32) -> Vec<(u32, f64)> {
    let mut d: Vec<(u32, f64)> = match dist::build(logits, t, top_k, top_p, &mut Scratch::default()) {
        Dist::Point(id) => vec![(id, 1.0)],
        Dist::Sparse { items, total } => items.iter().map(|&(i, w)| (i, w / total)).collect(),
        Dist::Dense { w, total, .. } => {
            w.iter().enumerate().filter(|e| *e.1 > 0.0).map(|(i, &x)| (i as u32, x as f64 / total)).collect()
        }
    };
    d.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    d
}

fn kept(logits: &[f32], top_k: usize, top_p: f32) -> Vec<u32> {
    kept_probs(logits, 1.0, top_k, top_p).into_iter().map(|c| c.0).collect()
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
    let mut s = Sampler::new(params(|p| p.temperature = 0.0), &[], 5, &[4]);
    assert_eq!(s.sample(&mut [0.0, 3.0, 1.0, 3.0, -1.0]), 1);
}

#[test]
fn a_vanishing_temperature_draws_among_the_maxima() {
    // 1/T overflows f32 at a subnormal T: the draw is still among the tied maxima, never a NaN-weighted pick.
    let mut s = Sampler::new(params(|p| p.temperature = 1e-40), &[], 6, &[5]);
    let draws: Vec<u32> = (0..200).map(|_| s.sample(&mut [0.0, 3.0, 1.0, 3.0, -1.0, 2.9])).collect();
    assert!(draws.iter().all(|&t| t == 1 || t == 3), "{draws:?}");
    assert!(draws.contains(&1) && draws.contains(&3));
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
        let mut s = Sampler::new(params(|p| p.seed = Some(seed)), &[], 1000, &[999]);
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
    let mut s = Sampler::new(p, &[0, 1], 6, &[5]);
    s.accept(2);
    s.accept(2);
    s.accept(3);
    let mut l = vec![4.0, -4.0, 4.0, -1.0, 4.0, 0.0];
    s.process(&mut l, true);
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
        &[3],
    );
    let mut l = vec![0.0, 0.0, 9.0, 9.0];
    s.process(&mut l, true);
    assert_eq!(l, vec![0.0, 0.0, f32::NEG_INFINITY, f32::NEG_INFINITY]);
    s.accept(0);
    let mut l = vec![0.0, 0.0, 9.0, 9.0];
    s.process(&mut l, true);
    assert_eq!(l, vec![0.0, 0.0, 9.0, 9.0]);
    assert!(s.is_stop(2) && s.is_stop(3) && !s.is_stop(1));

    let mut s = Sampler::new(params(|p| p.ignore_eos = true), &[], 4, &[3]);
    let mut l = vec![0.0, 0.0, 9.0, 9.0];
    s.process(&mut l, true);
    assert_eq!(l[3], f32::NEG_INFINITY);
    assert!(!s.is_stop(3));
}

#[test]
fn top_k_draws_only_the_k_best() {
    let mut s = Sampler::new(params(|p| p.top_k = 2), &[], 5, &[4]);
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
        &[logits.len() as u32 + 1],
    );
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..draws {
        counts[s.sample(&mut logits.to_vec()) as usize] += 1;
    }
    let kept = kept_probs(logits, t, 0, top_p);
    let ids: Vec<u32> = kept.iter().map(|c| c.0).collect();
    let mut chi = 0.0;
    for (id, p) in &kept {
        let e = p * draws as f64;
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
fn rejection_top_p_draws_the_nucleus_distribution() {
    // 40 tokens on a grid with ties. At top-p 0.6 the draws (by rejection from all 40) must match the nucleus of a
    // full sort; at 0.3 more than half of the draws miss, so some tokens come from the fallback to `build`.
    let logits: Vec<f32> = (0..40u32).map(|i| ((i * 7) % 13) as f32 / 4.0).collect();
    for (top_p, seed) in [(0.6, 1), (0.3, 2)] {
        let mut s = Sampler::new(
            params(|p| {
                p.top_p = top_p;
                p.seed = Some(seed);
            }),
            &[],
            logits.len(),
            &[99],
        );
        let draws = 40_000;
        let mut counts = vec![0f64; logits.len()];
        for _ in 0..draws {
            counts[s.sample(&mut logits.clone()) as usize] += 1.0;
        }
        let want = sorted_reference(&logits, 1.0, 0, top_p);
        let inside: f64 = want.iter().map(|e| counts[e.0 as usize]).sum();
        assert_eq!(inside, draws as f64, "top-p {top_p}: drew outside the nucleus");
        let chi: f64 =
            want.iter().map(|&(id, p)| (counts[id as usize] - p * draws as f64).powi(2) / (p * draws as f64)).sum();
        // The 0.999 quantile of chi-square with df = |nucleus| - 1 is below 3·df + 12 for these sizes (df ≤ 25).
        let df = (want.len() - 1) as f64;
        assert!(chi < 3.0 * df + 12.0, "top-p {top_p}: chi {chi}, df {df}");
    }
}

#[test]
fn chi_square_detects_a_wrong_temperature() {
    // The statistic has power: draws at T = 0.7 judged against T = 1.0 fail clearly.
    let logits = vec![1.0f32, 2.0, 0.5, -1.0, 1.5, 0.0];
    let mut s = Sampler::new(params(|p| p.temperature = 0.7), &[], 6, &[7]);
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

/// The kept set by a full sort of the vocabulary: the definition `dist::build` must agree with.
fn sorted_reference(logits: &[f32], t: f32, top_k: usize, top_p: f32) -> Vec<(u32, f64)> {
    let mut order: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize] > f32::NEG_INFINITY).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let max = logits[order[0] as usize] as f64;
    let w: Vec<(u32, f64)> = order.iter().map(|&i| (i, ((logits[i as usize] as f64 - max) / t as f64).exp())).collect();
    let total: f64 = w.iter().map(|e| e.1).sum();
    let (mut mass, mut keep) = (0.0, 0);
    for e in &w {
        mass += e.1;
        keep += 1;
        if mass >= top_p as f64 * total {
            break;
        }
    }
    let kept = &w[..keep];
    let sum: f64 = kept.iter().map(|e| e.1).sum();
    kept.iter().map(|&(i, x)| (i, x / sum)).collect()
}

/// A 5,000-token row: logits on a coarse grid (many exact ties), some masked, one far above the rest.
fn vocab_row(seed: u32) -> Vec<f32> {
    let mut l: Vec<f32> = (0..5000u32)
        .map(|i| {
            let h = i.wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)) >> 8;
            if h % 101 == 0 {
                f32::NEG_INFINITY
            } else {
                (h % 700) as f32 / 40.0 - 8.0
            }
        })
        .collect();
    if seed % 2 == 1 {
        l[4321] = 12.0;
    }
    l
}

#[test]
fn build_keeps_what_a_full_sort_keeps() {
    for seed in 0..6 {
        let l = vocab_row(seed);
        for &(t, k, p) in &[
            (1.0, 0, 0.9),
            (0.7, 0, 0.5),
            (1.3, 50, 1.0),
            (1.0, 40, 0.8),
            (0.05, 0, 0.99),
            (3.0, 0, 0.999),
            (1.0, 4999, 0.95),
            (1.0, 1, 1.0),
            (2.0, 0, 0.0),
        ] {
            let got = kept_probs(&l, t, k, p);
            let want = sorted_reference(&l, t, k, p);
            assert_eq!(got.len(), want.len(), "seed {seed} t {t} k {k} p {p}");
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g.0, w.0, "seed {seed} t {t} k {k} p {p}");
                assert!((g.1 - w.1).abs() <= 1e-6 * w.1 + 1e-12, "seed {seed} t {t} k {k} p {p}: {g:?} vs {w:?}");
            }
        }
        // Everything kept: the dense weights are softmax(l / T) over the unmasked tokens.
        let got = kept_probs(&l, 0.8, 0, 1.0);
        let want = sorted_reference(&l, 0.8, 0, 1.0);
        assert_eq!(got.iter().map(|e| e.0).collect::<Vec<_>>(), want.iter().map(|e| e.0).collect::<Vec<_>>());
    }
}

#[test]
fn top_k_over_few_finite_groups_keeps_what_a_full_sort_keeps() {
    // 120 finite logits in a run (a handful of groups of 16) among 5,000 masked ones: fewer group maxima than k, so
    // the threshold search runs over the logits themselves.
    let mut l = vec![f32::NEG_INFINITY; 5000];
    for (i, x) in l[2000..2120].iter_mut().enumerate() {
        *x = ((i * 37) % 29) as f32 / 7.0;
    }
    for &(k, p) in &[(50, 1.0), (100, 0.9), (119, 1.0), (120, 1.0), (121, 0.5)] {
        let got: Vec<u32> = kept_probs(&l, 1.0, k, p).into_iter().map(|e| e.0).collect();
        let want: Vec<u32> = sorted_reference(&l, 1.0, k, p).into_iter().map(|e| e.0).collect();
        assert_eq!(got, want, "k {k} p {p}");
    }
}

#[test]
fn a_draw_lands_where_the_cumulative_weights_put_it() {
    let l = vocab_row(3);
    let d = dist::build(&l, 1.0, 0, 1.0, &mut Scratch::default());
    let Dist::Dense { w, total, .. } = &d else { panic!("every token kept: dense weights") };
    for u in [0.0, 1e-9, 0.1, 0.25, 0.5, 0.77, 0.999_999, 1.0 - 1e-15] {
        let id = d.draw(u) as usize;
        let below: f64 = w[..id].iter().map(|&x| x as f64).sum();
        // Block sums are f32 within a block: positions agree to ~1e-7 of the total.
        let slack = 1e-6 * total;
        assert!(w[id] > 0.0 && below <= u * total + slack && u * total < below + w[id] as f64 + slack, "u {u}: {id}");
    }
    let sparse = dist::build(&l, 1.0, 3, 1.0, &mut Scratch::default());
    let Dist::Sparse { items, .. } = &sparse else { panic!("top-k: sparse") };
    assert_eq!(sparse.draw(0.0), items[0].0);
    assert_eq!(sparse.draw(0.999_999_999), items[2].0);
}

#[test]
fn residual_is_the_positive_part_of_p_minus_q() {
    let l = ln(&[0.1, 0.2, 0.5, 0.2]);
    let p = dist::build(&l, 1.0, 0, 1.0, &mut Scratch::default());
    let q = dist::build(&ln(&[0.4, 0.2, 0.3, 0.1]), 1.0, 0, 1.0, &mut Scratch::default());
    let Some(Dist::Sparse { items, total }) = Dist::residual(&p, &q) else { panic!("p > q somewhere") };
    // p - q = (-0.3, 0, 0.2, 0.1): ids 2 and 3 with 2/3 and 1/3.
    let got: Vec<(u32, f64)> = items.iter().map(|&(i, x)| (i, x / total)).collect();
    assert_eq!(got.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 3]);
    assert!((got[0].1 - 2.0 / 3.0).abs() < 1e-6 && (got[1].1 - 1.0 / 3.0).abs() < 1e-6, "{got:?}");
    assert!(Dist::residual(&p, &p).is_none());
    assert!((p.prob(2) - 0.5).abs() < 1e-6 && Dist::Point(3).prob(3) == 1.0 && Dist::Point(3).prob(2) == 0.0);
}
