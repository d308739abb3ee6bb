//! The global allocator (mimalloc) and the two calls the server makes on it.

/// mimalloc rather than the system allocator: a server allocates and frees buffers of many sizes from several
/// threads (logits of every batch width, activations, KV caches of requests that come and go). glibc's allocator
/// serves large blocks from its heap once a large block has been freed and keeps the pages of freed blocks, so a
/// server's resident memory climbed in steps under a mixed load; with mimalloc it stays level, and the engine is as
/// fast (docs/reliability.md has the measurements).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in the bundled mimalloc's `mi_option_e` (the sys crate names no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
/// Milliseconds mimalloc keeps freed pages before returning them to the system. Its default (1 s) let a server's
/// resident memory drift upwards under load (+8% in a one-minute soak); 10 ms held it level but returned the
/// buffers of a 16-stream batched step (logits alone are 3 MB) between steps, and the page faults of taking them
/// back cost that step 35%; 100 ms keeps them for the next step and still held the soak level.
const PURGE_DELAY_MS: std::ffi::c_long = 100;

/// Configure the allocator for serving, once, unless `MIMALLOC_PURGE_DELAY` is set (the user's choice wins).
pub fn configure_allocator() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            // SAFETY: setting an option only stores an integer in mimalloc's option table.
            unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) }
        }
    });
}

/// Hand memory that is free but still held by the allocator back to the system (an idle server calls it).
pub fn release_memory() {
    // SAFETY: `mi_collect` only walks the allocator's own free lists; it is safe to call from any thread at any time.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

#[cfg(test)]
mod allocator_tests {
    use super::*;

    #[test]
    fn purge_delay_option_is_the_one_configured() {
        // The option index is taken from mimalloc's header: its default (1000 ms) identifies it.
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(get(), 1000);
            configure_allocator();
            assert_eq!(get(), PURGE_DELAY_MS);
        }
    }
}
