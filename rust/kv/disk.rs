//! The prompt cache's directory: one file per kept prefix, so that a restarted server (or one that unloaded its model)
//! starts from the prefixes it had. Files are written to a temporary name and renamed into place, so a reader never
//! sees half a file; each carries the identity of what it was computed with (model file hash, KV mode and shape: the
//! `identity` string), the loop depth, window and tokens, and a checksum of its KV bytes. A file that is damaged,
//! cut short or written for another identity is never used: it is reported (once, as a notice the server logs) and
//! skipped — a damaged file of this identity is also deleted. The directory is bounded by bytes, least recently used
//! files removed first; only this identity's files are counted and removed.
//!
//! Layout, little-endian: `TLPROMPT`, u32 version, u32 identity length + identity, u64 loops, u64 window,
//! u64 token count + u32 tokens, u64 KV length, u64 checksum of the KV bytes, the KV bytes (`KvCache::encode`).

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use super::cache::{KvCache, KvKind};
use crate::kernels::AttnShape;

const MAGIC: &[u8; 8] = b"TLPROMPT";
const VERSION: u32 = 1;
const EXT: &str = "tlpc";
/// Longest identity string a header may carry (a damaged length must not allocate much).
const MAX_IDENTITY: usize = 4096;

/// What must match for a prefix's KV to be reusable (for an entry in memory and a file alike): the loop depth and the
/// attention window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixKey {
    pub loops: usize,
    pub window: usize,
}

#[derive(Debug, Clone)]
pub struct DiskConfig {
    pub dir: PathBuf,
    pub max_bytes: u64,
    /// What the KV was computed with; files with another identity are ignored.
    pub identity: String,
    pub kind: KvKind,
    pub shape: AttnShape,
}

struct File {
    path: PathBuf,
    key: PrefixKey,
    tokens: Vec<u32>,
    bytes: u64,
    used: u128,
}

#[derive(Default)]
struct Index {
    files: Vec<File>,
    notices: Vec<String>,
}

/// Work for the writer thread: a file to write, or a request to say when everything before it is written.
enum Job {
    Write { key: PrefixKey, tokens: Vec<u32>, kv: Vec<u8> },
    Flush(mpsc::Sender<()>),
}

pub struct Disk {
    cfg: DiskConfig,
    index: Arc<Mutex<Index>>,
    /// One writer thread, so files are written (and age) in the order their sequences finished.
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    writer: Option<JoinHandle<()>>,
}

/// 64-bit hash of `bytes` continuing from `h` (a word-at-a-time multiply-xor mix: meant to catch damage, not
/// adversaries — the directory is the user's own).
pub fn hash64(mut h: u64, bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().expect("8 bytes"))).wrapping_mul(K).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(K).rotate_left(29);
    }
    (h ^ bytes.len() as u64).wrapping_mul(K) ^ (h >> 32)
}

/// `hash64` of a whole file, read in 1 MiB pieces (each piece's hash chains into the next).
pub fn hash_file(path: &Path) -> io::Result<u64> {
    let mut f = fs::File::open(path)?;
    let (mut buf, mut h) = (vec![0u8; 1 << 20], 0u64);
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(h);
        }
        h = hash64(h, &buf[..n]);
    }
}

fn now() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn lock(index: &Mutex<Index>) -> MutexGuard<'_, Index> {
    index.lock().unwrap_or_else(|e| e.into_inner())
}

fn u32_at(b: &[u8], at: &mut usize) -> Option<u32> {
    let v = u32::from_le_bytes(b.get(*at..*at + 4)?.try_into().ok()?);
    *at += 4;
    Some(v)
}

fn u64_at(b: &[u8], at: &mut usize) -> Option<u64> {
    let v = u64::from_le_bytes(b.get(*at..*at + 8)?.try_into().ok()?);
    *at += 8;
    Some(v)
}

/// A file's header: identity, key, tokens, KV length and checksum, and where the KV bytes start.
struct Header {
    identity: String,
    key: PrefixKey,
    tokens: Vec<u32>,
    kv_len: u64,
    checksum: u64,
    start: usize,
}

/// Parse a header from the start of `b` (`size`: the whole file's length). Every length is checked against `size`.
fn parse_header(b: &[u8], size: u64) -> Result<Header, String> {
    let short = || "cut short".to_string();
    if b.get(..8) != Some(MAGIC.as_slice()) {
        return Err("not a tinyloop prompt-cache file".into());
    }
    let mut at = 8;
    let version = u32_at(b, &mut at).ok_or_else(short)?;
    if version != VERSION {
        return Err(format!("format version {version}, this build reads {VERSION}"));
    }
    let id_len = u32_at(b, &mut at).ok_or_else(short)? as usize;
    if id_len > MAX_IDENTITY {
        return Err(format!("identity of {id_len} bytes"));
    }
    let identity = String::from_utf8_lossy(b.get(at..at + id_len).ok_or_else(short)?).into_owned();
    at += id_len;
    let loops = u64_at(b, &mut at).ok_or_else(short)? as usize;
    let window = u64_at(b, &mut at).ok_or_else(short)? as usize;
    let n = u64_at(b, &mut at).ok_or_else(short)?;
    if n.saturating_mul(4) > size {
        return Err(format!("{n} tokens in a file of {size} bytes"));
    }
    let raw = b.get(at..at + 4 * n as usize).ok_or_else(short)?;
    let tokens = raw.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
    at += 4 * n as usize;
    let kv_len = u64_at(b, &mut at).ok_or_else(short)?;
    let checksum = u64_at(b, &mut at).ok_or_else(short)?;
    if at as u64 + kv_len != size {
        return Err(format!("{} bytes, the header describes {}", size, at as u64 + kv_len));
    }
    Ok(Header { identity, key: PrefixKey { loops, window }, tokens, kv_len, checksum, start: at })
}

/// Read just enough of `path` for its header.
fn read_header(path: &Path) -> Result<Header, String> {
    let mut f = fs::File::open(path).map_err(|e| e.to_string())?;
    let size = f.metadata().map_err(|e| e.to_string())?.len();
    let mut head = read_up_to(&mut f, Vec::new(), 16 + MAX_IDENTITY + 24).map_err(|e| e.to_string())?;
    let id_end = 16 + head.get(12..16).map_or(0, |l| u32::from_le_bytes(l.try_into().expect("4 bytes")) as usize);
    let n = head.get(id_end + 16..id_end + 24).map_or(0, |c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
    let want = (id_end as u64 + 24).saturating_add(n.saturating_mul(4)).saturating_add(16);
    if want <= size && want > head.len() as u64 {
        head = read_up_to(&mut f, head, want as usize).map_err(|e| e.to_string())?;
    }
    parse_header(&head, size)
}

/// `buf` extended with what `f` holds, up to `len` bytes in all.
fn read_up_to(f: &mut fs::File, mut buf: Vec<u8>, len: usize) -> io::Result<Vec<u8>> {
    let have = buf.len();
    f.take((len.saturating_sub(have)) as u64).read_to_end(&mut buf)?;
    Ok(buf)
}

impl Disk {
    /// Open (creating it, private to the user) `cfg.dir` and index the files of `cfg.identity`; what is skipped is
    /// reported in `notices`.
    pub fn open(cfg: DiskConfig, notices: &mut Vec<String>) -> Self {
        let mut index = Index::default();
        if let Err(e) = create_private_dir(&cfg.dir) {
            notices.push(format!("prompt cache directory {}: {e}; prefixes will not persist", cfg.dir.display()));
        }
        let mut foreign = 0;
        for path in fs::read_dir(&cfg.dir).into_iter().flatten().flatten().map(|e| e.path()) {
            if path.extension().and_then(|e| e.to_str()) != Some(EXT) {
                continue;
            }
            match read_header(&path) {
                Ok(h) if h.identity != cfg.identity => foreign += 1,
                Ok(h) => {
                    let used = fs::metadata(&path).and_then(|m| m.modified()).ok();
                    let used = used.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
                    let bytes = fs::metadata(&path).map_or(0, |m| m.len());
                    index.files.push(File { path, key: h.key, tokens: h.tokens, bytes, used });
                }
                Err(why) => notices.push(format!("ignoring prompt cache file {}: {why}", path.display())),
            }
        }
        if foreign > 0 {
            notices.push(format!(
                "ignoring {foreign} prompt cache file(s) in {} written for another model file or KV mode",
                cfg.dir.display()
            ));
        }
        let index = Arc::new(Mutex::new(index));
        let (tx, rx) = mpsc::channel::<Job>();
        let (wcfg, windex) = (cfg.clone(), index.clone());
        let writer = std::thread::Builder::new().name("tinyloop-prompt-cache".into()).spawn(move || {
            for job in rx {
                match job {
                    Job::Write { key, tokens, kv } => {
                        if let Err(e) = write_file(&wcfg, &windex, key, tokens, &kv) {
                            lock(&windex).notices.push(format!("prompt cache directory {}: {e}", wcfg.dir.display()));
                        }
                    }
                    Job::Flush(done) => {
                        let _ = done.send(()); // the flusher may have given up waiting; nothing to tell it then
                    }
                }
            }
        });
        let writer = match writer {
            Ok(handle) => Some(handle),
            Err(e) => {
                notices.push(format!("prompt cache: no writer thread ({e}); prefixes will not persist"));
                None
            }
        };
        Self { cfg, index, jobs: Mutex::new(writer.is_some().then_some(tx)), writer }
    }

    fn send(&self, job: Job) -> bool {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }

    /// The file whose tokens share more than `than` leading tokens with `prompt` (counting at most `limit`), the
    /// longest such, read and checked; `None` if there is none or it fails its checks (then it is deleted).
    pub fn load_longer(
        &self,
        key: PrefixKey,
        prompt: &[u32],
        than: usize,
        limit: usize,
        notices: &mut Vec<String>,
    ) -> Option<(Vec<u32>, KvCache)> {
        let common = |t: &[u32]| t.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(limit);
        let path = {
            let index = lock(&self.index);
            let best = index.files.iter().filter(|f| f.key == key).max_by_key(|f| common(&f.tokens))?;
            (common(&best.tokens) > than).then(|| best.path.clone())?
        };
        match self.read(&path) {
            Ok((h, cache)) if h.key == key => {
                if let Some(f) = lock(&self.index).files.iter_mut().find(|f| f.path == path) {
                    f.used = now();
                }
                Some((h.tokens, cache))
            }
            Ok(_) => None,
            Err(why) => {
                notices.push(format!("ignoring prompt cache file {} and deleting it: {why}", path.display()));
                lock(&self.index).files.retain(|f| f.path != path);
                let _ = fs::remove_file(&path); // already reported as unusable; a failed delete changes nothing
                None
            }
        }
    }

    /// Read a whole file, checking its header, identity and checksum, and decode its KV.
    fn read(&self, path: &Path) -> Result<(Header, KvCache), String> {
        let bytes = fs::read(path).map_err(|e| e.to_string())?;
        let h = parse_header(&bytes, bytes.len() as u64)?;
        if h.identity != self.cfg.identity {
            return Err("written for another model file or KV mode".into());
        }
        let kv = &bytes[h.start..];
        if kv.len() as u64 != h.kv_len || hash64(0, kv) != h.checksum {
            return Err("checksum mismatch".into());
        }
        let cache = KvCache::decode(self.cfg.kind, self.cfg.shape, h.tokens.len(), kv).map_err(|e| e.to_string())?;
        if cache.complete_positions() < h.tokens.len() {
            return Err("holds fewer positions than tokens".into());
        }
        Ok((h, cache))
    }

    /// Write an entry in the background (the caller is a request finishing; disks can be slow).
    pub fn write(&self, key: PrefixKey, tokens: &[u32], cache: &KvCache) {
        let mut kv = Vec::new();
        cache.encode(&mut kv);
        self.send(Job::Write { key, tokens: tokens.to_vec(), kv });
    }

    /// Wait until every write queued so far is done.
    pub fn flush(&self) {
        let (tx, rx) = mpsc::channel();
        if self.send(Job::Flush(tx)) {
            let _ = rx.recv(); // an error means the writer ended, which also means nothing is left to write
        }
    }

    pub fn take_notices(&self) -> Vec<String> {
        std::mem::take(&mut lock(&self.index).notices)
    }
}

impl Drop for Disk {
    /// Finish the queued writes: a server shutting down or unloading its model keeps what it had.
    fn drop(&mut self) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join(); // a writer that panicked left no file half-written (temporary names)
        }
    }
}

#[cfg(unix)]
fn create_private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

#[cfg(not(unix))]
fn create_private_dir(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir)
}

/// Write one file atomically, then drop the files it makes redundant and the least recently used ones over budget.
fn write_file(cfg: &DiskConfig, index: &Mutex<Index>, key: PrefixKey, tokens: Vec<u32>, kv: &[u8]) -> io::Result<()> {
    let mut head = Vec::with_capacity(64 + cfg.identity.len() + 4 * tokens.len());
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&(cfg.identity.len() as u32).to_le_bytes());
    head.extend_from_slice(cfg.identity.as_bytes());
    for v in [key.loops as u64, key.window as u64, tokens.len() as u64] {
        head.extend_from_slice(&v.to_le_bytes());
    }
    tokens.iter().for_each(|t| head.extend_from_slice(&t.to_le_bytes()));
    head.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    head.extend_from_slice(&hash64(0, kv).to_le_bytes());
    let tag = hash64(hash64(0, cfg.identity.as_bytes()), &head);
    let path = cfg.dir.join(format!("{tag:016x}.{EXT}"));
    let tmp = cfg.dir.join(format!(".{tag:016x}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&head)?;
        f.write_all(kv)?;
        f.sync_all()?;
        fs::rename(&tmp, &path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp); // the write's own error is what gets reported
        return written;
    }
    let bytes = (head.len() + kv.len()) as u64;
    let mut index = lock(index);
    let stale: Vec<PathBuf> = index
        .files
        .iter()
        .filter(|f| f.key == key && f.path != path && tokens.starts_with(&f.tokens))
        .map(|f| f.path.clone())
        .collect();
    index.files.retain(|f| f.path != path && !stale.contains(&f.path));
    index.files.push(File { path, key, tokens, bytes, used: now() });
    let mut removed = stale;
    while index.files.iter().map(|f| f.bytes).sum::<u64>() > cfg.max_bytes {
        let Some(oldest) = index.files.iter().enumerate().min_by_key(|(_, f)| f.used).map(|(i, _)| i) else { break };
        removed.push(index.files.swap_remove(oldest).path);
    }
    drop(index);
    for p in removed {
        fs::remove_file(&p)?;
    }
    Ok(())
}
