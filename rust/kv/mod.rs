//! The KV cache (`cache/`: storage, windows, rollback, loops sharing KV, encoding), the formats it stores rows in (`elem.rs`), attention
//! over it (`attend.rs`), and the prompt cache of finished sequences' KV (`prefix.rs`, with its files: `disk.rs`).

mod attend;
mod cache;
mod disk;
mod elem;
mod prefix;

pub use attend::RowLayout;
pub use cache::{KvCache, KvKind};
pub use disk::{hash_file, DiskConfig, PrefixKey};
pub use prefix::{PrefixConfig, PrefixStore, Reused};
