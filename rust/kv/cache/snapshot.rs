//! A cache's live positions as bytes and back (the prompt cache's files): per slot a presence byte, the positions
//! it holds, then per K/V head its rows and row metadata in the slot's own element format, little-endian. Decoding
//! checks every length against the bytes actually there before allocating, so a damaged file is an error, never a
//! panic or a huge allocation.

use half::f16;

use super::{KvCache, KvKind, Slot, SlotBuf};
use crate::error::{Error, Result};
use crate::kernels::AttnShape;
use crate::kv::elem::{Int4Meta, KvElem, Nibbles};

/// Fixed-size little-endian encoding of a stored element or its row metadata.
pub(super) trait Raw: Copy + Default {
    const BYTES: usize;
    fn put(self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
}

impl Raw for f32 {
    const BYTES: usize = 4;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn get(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Raw for f16 {
    const BYTES: usize = 2;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn get(b: &[u8]) -> Self {
        f16::from_le_bytes([b[0], b[1]])
    }
}

impl Raw for i8 {
    const BYTES: usize = 1;
    fn put(self, out: &mut Vec<u8>) {
        out.push(self as u8);
    }
    fn get(b: &[u8]) -> Self {
        b[0] as i8
    }
}

impl Raw for Nibbles {
    const BYTES: usize = 1;
    fn put(self, out: &mut Vec<u8>) {
        out.push(self.0);
    }
    fn get(b: &[u8]) -> Self {
        Nibbles(b[0])
    }
}

impl Raw for () {
    const BYTES: usize = 0;
    fn put(self, _: &mut Vec<u8>) {}
    fn get(_: &[u8]) -> Self {}
}

impl Raw for Int4Meta {
    const BYTES: usize = 4;
    fn put(self, out: &mut Vec<u8>) {
        self.scale.put(out);
        self.min.put(out);
    }
    fn get(b: &[u8]) -> Self {
        Int4Meta { scale: f16::get(b), min: f16::get(&b[2..]) }
    }
}

/// Reads the encoding front to back; every read checks that the bytes are there.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.bytes.len() {
            return Err(Error::Internal(format!("KV snapshot cut short: {n} bytes needed, {} left", self.bytes.len())));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn values<T: Raw>(&mut self, count: usize, into: &mut [T]) -> Result<()> {
        let b = self.take(count.checked_mul(T::BYTES).ok_or_else(|| Error::Internal("KV snapshot size".into()))?)?;
        for (x, chunk) in into[..count].iter_mut().zip(b.chunks_exact(T::BYTES.max(1))) {
            *x = T::get(chunk);
        }
        Ok(())
    }
}

impl<T: KvElem + Raw> Slot<T>
where
    T::Meta: Raw,
{
    fn encode(&self, heads: usize, hd: usize, out: &mut Vec<u8>) {
        let (w, n, s) = (hd / T::PACK, self.len, self.stride);
        out.extend_from_slice(&(n as u64).to_le_bytes());
        for rows in [&self.k, &self.v] {
            for g in 0..heads {
                rows[g * s * w..][..n * w].iter().for_each(|x| x.put(out));
            }
        }
        for meta in [&self.k_meta, &self.v_meta] {
            for g in 0..heads {
                meta[g * s..][..n].iter().for_each(|x| x.put(out));
            }
        }
    }

    fn decode(r: &mut Reader, heads: usize, hd: usize, cap: usize) -> Result<Self> {
        let n = usize::try_from(r.u64()?).map_err(|_| Error::Internal("KV snapshot length".into()))?;
        let w = hd / T::PACK;
        let per_pos = 2 * heads * (w * T::BYTES + T::Meta::BYTES);
        if n > cap || n.saturating_mul(per_pos) > r.bytes.len() {
            return Err(Error::Internal(format!("KV snapshot slot of {n} positions does not fit its bytes")));
        }
        let mut slot = Slot::new();
        slot.reserve(heads, hd, n, cap);
        let s = slot.stride;
        for rows in [&mut slot.k, &mut slot.v] {
            for g in 0..heads {
                r.values(n * w, &mut rows[g * s * w..])?;
            }
        }
        for meta in [&mut slot.k_meta, &mut slot.v_meta] {
            for g in 0..heads {
                r.values(n, &mut meta[g * s..])?;
            }
        }
        slot.len = n;
        Ok(slot)
    }
}

impl KvCache {
    /// Append every written slot's positions (all from position 0: see `prefix`) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (heads, hd) = (self.shape.n_kv_heads, self.shape.head_dim);
        out.extend_from_slice(&(self.slots.len() as u64).to_le_bytes());
        for slot in &self.slots {
            match slot {
                None => out.push(0),
                Some(buf) => {
                    out.push(1);
                    match buf {
                        SlotBuf::F32(s) => s.encode(heads, hd, out),
                        SlotBuf::F16(s) => s.encode(heads, hd, out),
                        SlotBuf::I8(s) => s.encode(heads, hd, out),
                        SlotBuf::I4(s) => s.encode(heads, hd, out),
                        SlotBuf::Dev(s) => match super::device::to_host(s) {
                            Ok(SlotBuf::F32(s)) => s.encode(heads, hd, out),
                            Ok(SlotBuf::F16(s)) => s.encode(heads, hd, out),
                            _ => out.extend_from_slice(&0u64.to_le_bytes()), // an empty slot: nothing reused
                        },
                    }
                }
            }
        }
    }

    /// The cache `encode` wrote, for a model with this `kind` and `shape`, allowed `capacity` positions.
    pub fn decode(kind: KvKind, shape: AttnShape, capacity: usize, bytes: &[u8]) -> Result<KvCache> {
        let mut r = Reader { bytes };
        let (heads, hd) = (shape.n_kv_heads, shape.head_dim);
        let n_slots = r.u64()? as usize;
        if n_slots > bytes.len() {
            return Err(Error::Internal(format!("KV snapshot claims {n_slots} slots")));
        }
        let mut slots = Vec::with_capacity(n_slots);
        for _ in 0..n_slots {
            slots.push(match r.take(1)?[0] {
                0 => None,
                1 => Some(match kind {
                    KvKind::F32 => SlotBuf::F32(Slot::decode(&mut r, heads, hd, capacity)?),
                    KvKind::F16 => SlotBuf::F16(Slot::decode(&mut r, heads, hd, capacity)?),
                    KvKind::Int8 => SlotBuf::I8(Slot::decode(&mut r, heads, hd, capacity)?),
                    KvKind::Int4 | KvKind::Int4H => SlotBuf::I4(Slot::decode(&mut r, heads, hd, capacity)?),
                }),
                other => return Err(Error::Internal(format!("KV snapshot slot tag {other}"))),
            });
        }
        if !r.bytes.is_empty() {
            return Err(Error::Internal(format!("KV snapshot has {} bytes past its end", r.bytes.len())));
        }
        Ok(KvCache { kind, shape, capacity, window: 0, slots, share: None, device: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(kind: KvKind, n: usize) -> KvCache {
        let shape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 8 };
        let mut cache = KvCache::new(kind, shape, 300, 3);
        let row = |i: usize, s: u32| ((i as u32).wrapping_mul(2654435761).wrapping_add(s) % 997) as f32 / 500.0 - 1.0;
        let kv = |s| (0..n * 16).map(|i| row(i, s)).collect::<Vec<f32>>();
        let q: Vec<f32> = (0..n * 32).map(|i| row(i, 9)).collect();
        let mut out = vec![0.0; q.len()];
        for slot in [0, 2] {
            // Slot 1 stays unwritten, as a deeper loop's slot does in a shallower request.
            cache.write_and_attend(slot, 0, &kv(slot as u32), &kv(7 + slot as u32), &q, &mut out).unwrap();
        }
        cache
    }

    /// Attention output of one query row at position `n` over the cache, for comparing two caches' contents.
    fn probe(cache: &mut KvCache, n: usize) -> Vec<f32> {
        let (k, v, q) = (vec![0.25; 16], vec![-0.5; 16], (0..32).map(|i| i as f32 / 32.0).collect::<Vec<_>>());
        let mut out = vec![0.0; 32];
        cache.write_and_attend(2, n, &k, &v, &q, &mut out).unwrap();
        out
    }

    #[test]
    fn encoded_caches_decode_to_the_same_rows_and_damage_is_an_error() {
        for kind in [KvKind::F32, KvKind::F16, KvKind::Int8, KvKind::Int4, KvKind::Int4H] {
            let n = 100; // past the first stride: the encoding holds positions, not the allocation
            let cache = filled(kind, n);
            let mut bytes = Vec::new();
            cache.encode(&mut bytes);
            let mut back = KvCache::decode(kind, cache.shape, 300, &bytes).unwrap();
            assert_eq!((back.slot_len(0), back.slot_len(1), back.slot_len(2)), (n, 0, n));
            assert_eq!(back.complete_positions(), n);
            let mut prefix = cache.prefix(n, 300, 0).unwrap();
            assert_eq!(probe(&mut back, n), probe(&mut prefix, n), "{kind:?}");
            for cut in [0, 7, 8, 9, bytes.len() / 2, bytes.len() - 1] {
                assert!(KvCache::decode(kind, cache.shape, 300, &bytes[..cut]).is_err(), "{kind:?} cut at {cut}");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(KvCache::decode(kind, cache.shape, 300, &longer).is_err());
            let mut huge = bytes.clone();
            huge[9..17].copy_from_slice(&(u64::MAX / 2).to_le_bytes()); // slot 0's position count
            assert!(KvCache::decode(kind, cache.shape, 300, &huge).is_err());
            assert!(KvCache::decode(kind, cache.shape, 50, &bytes).is_err(), "more positions than the capacity");
        }
    }

    #[test]
    fn a_prefix_is_refused_when_a_slot_holds_fewer_positions() {
        let cache = filled(KvKind::F16, 40);
        assert!(cache.prefix(40, 64, 0).is_some() && cache.prefix(41, 64, 0).is_none());
        let mut short = cache.prefix(40, 64, 0).unwrap();
        short.truncate(30);
        assert_eq!(short.complete_positions(), 30);
    }
}
