//! KV shared across loops (`kv_share = "last"`, the decoding scheme of Ouro's looped models): once a sequence's prompt
//! is in, each block layer keeps one slot — the last loop's K/V — instead of one per loop, and every loop of a new
//! token attends to past positions through it. The prompt itself is prefilled with a slot per loop, as always (so a
//! chunked prefill computes what one pass does), and `collapse` then keeps each layer's last-loop slot. A decode step
//! writes its row into the shared slot at every loop — loop l's row overwrites loop l−1's — so the row a later
//! position sees is the deepest loop's, and each loop's own row is there while it attends.
//!
//! Memory per position after the prompt: `prelude + block` slots instead of `prelude + loops · block`.

use super::{KvCache, LoopShare};

impl KvCache {
    /// Share one slot per block layer across loops once `collapse` is called (slots below `prelude` are the
    /// prelude's own).
    pub fn with_shared_loops(mut self, prelude: usize, block: usize) -> Self {
        self.share = Some(LoopShare { prelude, block, collapsed: false });
        self
    }

    /// Whether this cache's loops share their K/V once collapsed.
    pub fn shares_loops(&self) -> bool {
        self.share.is_some()
    }

    /// The slot that holds logical slot `slot` (a loop's layer maps to its layer's shared slot once collapsed).
    pub(super) fn physical(&self, slot: usize) -> usize {
        match self.share {
            Some(LoopShare { prelude, block, collapsed: true }) if slot >= prelude => {
                prelude + (slot - prelude) % block
            }
            _ => slot,
        }
    }

    /// Keep only the last of `loops` loops' K/V for each block layer (the prompt is in; decoding starts). Does
    /// nothing on a cache that does not share loops or has collapsed already.
    pub fn collapse(&mut self, loops: usize) {
        let Some(share) = self.share.as_mut().filter(|s| !s.collapsed && loops >= 1) else { return };
        share.collapsed = true;
        let LoopShare { prelude, block, .. } = *share;
        for layer in 0..block {
            let last = self.slots[prelude + (loops - 1) * block + layer].take();
            self.slots[prelude + layer] = last;
        }
        for slot in &mut self.slots[prelude + block..] {
            *slot = None;
        }
    }
}
