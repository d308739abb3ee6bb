//! This machine's read bandwidth at a working-set size, for the benches to set a kernel's rate beside the level
//! of the memory hierarchy its bytes come from (`benches/bench_machine.py`): each of `threads` threads reads its
//! own buffer of `bytes` over and over, all starting together, and the best pass over all of them counts.
//! Buffers that fit a core's L2 measure L2, ones past the sum of the L2s but inside L3 measure L3, and so on.

use std::sync::Barrier;
use std::time::Instant;

/// Bytes each timed pass reads per thread at least (so a pass over an L2-sized buffer lasts a millisecond or so,
/// far above the timer's resolution and a barrier's cost).
const PASS_BYTES: usize = 64 << 20;

/// GB/s of `threads` threads each reading `bytes` of its own (best of `passes` timed passes, after one untimed).
pub fn read_bandwidth(bytes: usize, threads: usize, passes: usize) -> f64 {
    let words = (bytes / 8).max(64) / 64 * 64;
    let reps = PASS_BYTES.div_ceil(words * 8);
    let barrier = Barrier::new(threads.max(1));
    let times: Vec<f64> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| {
                    let buf: Vec<u64> = (0..words as u64).collect();
                    let mut best = f64::INFINITY;
                    for pass in 0..=passes {
                        barrier.wait();
                        let start = Instant::now();
                        for _ in 0..reps {
                            std::hint::black_box(xor_all(std::hint::black_box(&buf)));
                        }
                        barrier.wait(); // the pass ends when the slowest thread's does
                        if pass > 0 {
                            best = best.min(start.elapsed().as_secs_f64());
                        }
                    }
                    best
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap_or(f64::INFINITY)).collect()
    });
    let slowest = times.into_iter().fold(0f64, f64::max);
    (threads.max(1) * reps * words * 8) as f64 / slowest / 1e9
}

/// Every word of `buf` once, in order, into eight independent lanes (vector loads at the build's width).
fn xor_all(buf: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for c in buf.chunks_exact(8) {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a ^= v;
        }
    }
    acc.iter().fold(0, |x, &y| x ^ y)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_small_buffer_reads_faster_than_a_large_one() {
        let (small, large) = (super::read_bandwidth(16 << 10, 1, 3), super::read_bandwidth(256 << 20, 1, 1));
        assert!(small > large && large > 0.1, "{small} GB/s from L1, {large} GB/s from memory");
    }
}
