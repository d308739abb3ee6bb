//! The prompt cache: KV of recently finished sequences, kept so that a request whose prompt starts with the same
//! tokens (the next turn of a conversation re-sends all earlier turns) prefills only what is new.
//!
//! A sequence's KV at position p depends only on tokens `0..=p`, the loop depth and the attention window, so a
//! request may reuse the first `m` positions of any entry of the same depth and window whose tokens agree with its
//! prompt on those `m` (the longest common prefix, at most the prompt's length minus one: the last prompt token is
//! always fed, since its logits choose the first output token). Entries are bounded by bytes and by count, least
//! recently used evicted; an entry whose tokens another one extends is dropped as redundant. With a directory
//! (`disk.rs`), entries are also written to files that outlive the process.

use std::sync::Mutex;

use super::cache::KvCache;
use super::disk::{Disk, DiskConfig, PrefixKey};

/// Bounds of the in-memory cache (0 entries: off) and, optionally, its directory.
#[derive(Debug, Clone, Default)]
pub struct PrefixConfig {
    pub max_bytes: usize,
    pub max_entries: usize,
    pub disk: Option<DiskConfig>,
}

struct Entry {
    key: PrefixKey,
    tokens: Vec<u32>,
    cache: KvCache,
    bytes: usize,
    used: u64,
}

#[derive(Default)]
struct State {
    entries: Vec<Entry>,
    clock: u64,
    notices: Vec<String>,
}

/// A reused prefix: its length and a cache holding it, ready for the rest of the prompt.
pub struct Reused {
    pub tokens: usize,
    pub cache: KvCache,
}

#[derive(Default)]
pub struct PrefixStore {
    max_bytes: usize,
    max_entries: usize,
    state: Mutex<State>,
    disk: Option<Disk>,
}

/// Tokens `a` and `b` agree on before they first differ.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixStore {
    /// A store with these bounds (and directory, when `cfg.disk` is set).
    pub fn new(cfg: PrefixConfig) -> Self {
        let mut state = State::default();
        let disk = cfg.disk.map(|d| Disk::open(d, &mut state.notices));
        Self { max_bytes: cfg.max_bytes, max_entries: cfg.max_entries, state: Mutex::new(state), disk }
    }

    pub fn enabled(&self) -> bool {
        self.max_entries > 0 && self.max_bytes > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves entries that are each whole: keep using them.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The longest reusable prefix of `prompt` under `key`, restored into a cache of `capacity` positions with
    /// window `window` — from memory, or from a file when that one is longer.
    pub fn lookup(&self, key: PrefixKey, prompt: &[u32], capacity: usize, window: usize) -> Option<Reused> {
        if !self.enabled() || prompt.len() < 2 {
            return None;
        }
        let limit = (prompt.len() - 1).min(capacity);
        let mut state = self.lock();
        let best = state
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.key == key)
            .map(|(i, e)| (common_prefix(&e.tokens, prompt).min(limit), i))
            .max();
        let (mut m, mut at) = best.unwrap_or((0, usize::MAX));
        if let Some(disk) = &self.disk {
            if let Some((tokens, cache)) = disk.load_longer(key, prompt, m, limit, &mut state.notices) {
                let longer = common_prefix(&tokens, prompt).min(limit);
                // A file over the memory bound is not adopted (nothing is evicted for it): the memory's best stands.
                if let Some(i) = self.insert(&mut state, key, tokens, cache, false) {
                    (m, at) = (longer, i);
                }
            }
        }
        if m == 0 {
            return None;
        }
        state.clock += 1;
        let clock = state.clock;
        let entry = state.entries.get_mut(at)?;
        entry.used = clock;
        Some(Reused { tokens: m, cache: entry.cache.prefix(m, capacity, window)? })
    }

    /// Keep a finished sequence's KV: its first `cache.complete_positions()` positions of `tokens`.
    pub fn offer(&self, key: PrefixKey, mut tokens: Vec<u32>, cache: &KvCache) {
        if !self.enabled() {
            return;
        }
        let n = cache.complete_positions().min(tokens.len());
        tokens.truncate(n);
        let mut state = self.lock();
        let covered = state.entries.iter().any(|e| e.key == key && e.tokens.len() >= n && e.tokens[..n] == tokens[..]);
        if n == 0 || covered {
            return;
        }
        // A copy sized to the positions held: the request's own buffers may have grown past them.
        let Some(kept) = cache.prefix(n, n, 0) else { return };
        self.insert(&mut state, key, tokens, kept, true);
    }

    /// Add an entry (and write it to disk when `persist`), dropping the entries it makes redundant and then the least
    /// recently used until the bounds hold. Returns its index, or `None` if it alone exceeds the byte bound.
    fn insert(
        &self,
        state: &mut State,
        key: PrefixKey,
        tokens: Vec<u32>,
        cache: KvCache,
        persist: bool,
    ) -> Option<usize> {
        let bytes = cache.bytes_allocated();
        if bytes > self.max_bytes {
            return None;
        }
        state.entries.retain(|e| !(e.key == key && e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
        if persist {
            if let Some(disk) = &self.disk {
                disk.write(key, &tokens, &cache);
            }
        }
        state.clock += 1;
        let used = state.clock;
        state.entries.push(Entry { key, tokens, cache, bytes, used });
        while state.entries.len() > self.max_entries
            || state.entries.iter().map(|e| e.bytes).sum::<usize>() > self.max_bytes
        {
            let oldest = state.entries.iter().enumerate().min_by_key(|(_, e)| e.used).map(|(i, _)| i)?;
            state.entries.swap_remove(oldest);
        }
        state.entries.iter().position(|e| e.used == used)
    }

    /// (entries, bytes) held in memory.
    pub fn usage(&self) -> (usize, usize) {
        let state = self.lock();
        (state.entries.len(), state.entries.iter().map(|e| e.bytes).sum())
    }

    /// Drop every in-memory entry (files stay).
    pub fn clear(&self) {
        self.lock().entries.clear();
    }

    /// Messages about files that were ignored or could not be written, since the last call (for the server's log).
    pub fn take_notices(&self) -> Vec<String> {
        let mut notices = std::mem::take(&mut self.lock().notices);
        if let Some(disk) = &self.disk {
            notices.extend(disk.take_notices());
        }
        notices
    }

    /// Wait until every file write started so far has finished.
    pub fn flush(&self) {
        if let Some(disk) = &self.disk {
            disk.flush();
        }
    }
}
