//! How a slot's buffers grow, host or device: positions per head allocated at first, then at least doubling.

/// Positions a slot allocates per head at first.
pub(super) const FIRST_STRIDE: usize = 64;

/// The stride a slot of `stride` positions per head grows to so that it holds `need`: at least double, at least
/// `FIRST_STRIDE`, at most the sequence's capacity `cap` (unless `need` is more).
pub(super) fn next_stride(stride: usize, need: usize, cap: usize) -> usize {
    need.max(2 * stride).max(FIRST_STRIDE).min(cap.max(need))
}
