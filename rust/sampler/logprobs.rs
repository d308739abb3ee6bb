//! Log-probabilities of the emitted tokens as the model gives them: the log-softmax of the raw logits — before
//! penalties, temperature, top-k / top-p and grammar masks — which is what `Engine::score` computes, with the most
//! likely alternatives at each position (OpenAI's `logprobs` / `top_logprobs`).

/// One emitted token's log-probability and the `n` most likely tokens at its position, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// `token`'s entry in one row of raw logits, with the row's `n` most likely tokens.
    pub fn of(logits: &[f32], token: u32, n: usize) -> Self {
        Scored::of(logits, n).entry(token)
    }
}

/// A row's normaliser and best `n`, held from the moment the sampler sees the row until its token is emitted.
pub(super) struct Scored {
    raw: Vec<f32>,
    lse: f64,
    top: Vec<(u32, f32)>,
}

impl Scored {
    pub fn of(logits: &[f32], n: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let lse = f64::from(max) + sum.ln();
        let top = top_ids(logits, n).into_iter().map(|t| (t, (f64::from(logits[t as usize]) - lse) as f32)).collect();
        Self { raw: logits.to_vec(), lse, top }
    }

    pub fn entry(self, token: u32) -> TokenLogprob {
        let l = self.raw.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
        TokenLogprob { logprob: (f64::from(l) - self.lse) as f32, top: self.top }
    }
}

/// Ids of the `k` largest logits, best first (lower id first among equals).
pub fn top_ids(logits: &[f32], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(ids.len());
    if k == 0 {
        return Vec::new();
    }
    let order = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    ids.select_nth_unstable_by(k - 1, order);
    ids.truncate(k);
    ids.sort_by(order);
    ids
}
