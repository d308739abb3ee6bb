//! The KV cache (`cache.rs`: storage, windows, rollback), the formats it stores rows in (`elem.rs`), and attention
//! over it (`attend.rs`).

mod attend;
mod cache;
mod elem;

pub use attend::RowLayout;
pub use cache::{KvCache, KvKind};
