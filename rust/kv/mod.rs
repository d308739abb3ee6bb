//! The KV cache (`cache.rs`: storage, windows, rollback), the formats it stores rows in (`elem.rs`), attention
//! over it (`attend.rs`), and the prompt cache of finished sequences' KV (`prefix.rs`, with its files: `disk.rs`).

mod attend;
mod cache;
mod disk;
mod elem;
mod prefix;

pub use attend::RowLayout;
pub use cache::{KvCache, KvKind};
pub use disk::{hash_file, DiskConfig};
pub use prefix::{PrefixConfig, PrefixKey, PrefixStore, Reused};
