//! A fixed team of threads for the many small products of a decode step.
//!
//! A decode step of a looped model is a hundred or more matrix-vector products of a few hundred kilobytes each
//! (the default model: 2 layers × 8 loops × 7 matrices of 128–360 KB). Handing each one to rayon's pool costs a
//! wake-up and a join, about what the product itself costs, so below `PARALLEL_MIN` they ran on the calling thread
//! alone — from L3, since one core's L2 holds less than the whole block. The team splits every product into one
//! contiguous part per core, always the same part on the same core, so that each core's share of the block's
//! weights stays in its own L2 from loop to loop; its workers spin between the products of a step and
//! sleep once none has come for that long (`spin`).
//!
//! The caller runs part 0 and then takes any part a worker has not claimed yet (a sleeping worker's, the first
//! product after a pause): a product never waits for a thread to wake up, only for parts already running. Only
//! the outputs' placement depends on who runs a part, never their arithmetic.
//!
//! The team serves one caller at a time, and no thread inside `alone` (a batched step whose sequences are already
//! split across rayon's threads, one group per core); `spread` returns false to the others, and they run their work
//! another way. The engine's steps run on a rayon worker (`py::errors::computed`), which is then the team's member
//! 0, so a step keeps one thread per core busy.

use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long a worker spins for the next product before it sleeps, unless `TINYLOOP_SPIN_US` sets it (0: no team,
/// each product on its caller's thread, as a machine shared with other work may prefer): longer than the gaps inside
/// a step (norms, attention: microseconds) and than a caller's usual pause between steps outside the engine, so that
/// a decoding stream's workers stay awake; an idle server's sleep within a millisecond.
const SPIN_US: u64 = 1000;

fn spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("TINYLOOP_SPIN_US").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(SPIN_US);
        Duration::from_micros(us)
    })
}
/// How long a worker spins without yielding its core: the gaps between the products of one step.
const HOT: Duration = Duration::from_micros(50);
/// Most members (caller included): the parts to claim are the bits of one word.
const MAX_MEMBERS: usize = usize::BITS as usize;

/// One product: the work and how it is split. It lives on the caller's stack for the duration of `spread`.
struct Job<'a> {
    work: &'a (dyn Fn(Range<usize>) + Sync),
    count: usize,
    parts: usize,
}

struct Team {
    /// One per worker (member 1, 2, …); the caller is member 0.
    workers: Vec<Worker>,
    /// Set while a caller holds the team.
    busy: AtomicBool,
    /// The job in flight (valid while any of its parts is unclaimed or running).
    job: AtomicPtr<Job<'static>>,
    /// Bit p set: part p is yet to be claimed.
    open: AtomicUsize,
    /// Parts run by workers so far in this job.
    done: AtomicUsize,
    /// A worker's part panicked in this job.
    panicked: AtomicBool,
}

struct Worker {
    thread: OnceLock<Thread>,
    sleeping: AtomicBool,
}

static TEAM: OnceLock<Option<&'static Team>> = OnceLock::new();

/// The team, started on first use with one member per thread of rayon's pool (`RAYON_NUM_THREADS`, else one per
/// core); None with a single thread, `TINYLOOP_SPIN_US=0`, or where threads cannot start.
fn team() -> Option<&'static Team> {
    *TEAM.get_or_init(|| {
        let members = rayon::current_num_threads().min(MAX_MEMBERS);
        if members < 2 || spin().is_zero() {
            return None;
        }
        let team: &'static Team = Box::leak(Box::new(Team {
            workers: (1..members)
                .map(|_| Worker { thread: OnceLock::new(), sleeping: AtomicBool::new(false) })
                .collect(),
            busy: AtomicBool::new(false),
            job: AtomicPtr::new(std::ptr::null_mut()),
            open: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        }));
        for member in 1..members {
            let handle = thread::Builder::new()
                .name(format!("tinyloop-team-{member}"))
                .spawn(move || team.serve(member))
                .ok()?;
            // The worker only reads its own `thread` after it has been unparked, which needs it set.
            team.workers[member - 1].thread.set(handle.thread().clone()).ok()?;
        }
        Some(team)
    })
}

thread_local! {
    /// Set inside `alone`.
    static ALONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f` with the team refused to this thread: for work that already has one thread per core of its own.
pub(crate) fn alone<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ALONE.set(self.0);
        }
    }
    let _restore = Restore(ALONE.replace(true));
    f()
}

/// Part `p` of `parts` contiguous parts of `0..count`.
fn part(count: usize, parts: usize, p: usize) -> Range<usize> {
    count * p / parts..count * (p + 1) / parts
}

/// Run `work` over `0..count` split across the team, each member one contiguous range (the same member the same
/// range for the same `count`), and return true; or return false without running anything when the team is not
/// available to this call (no team, inside `alone`, another caller holding it) — the caller then runs
/// `work` itself. A panic in any part is raised here once every part has finished.
pub(crate) fn spread(count: usize, work: &(dyn Fn(Range<usize>) + Sync)) -> bool {
    let Some(team) = team() else { return false };
    if ALONE.get() || team.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        return false;
    }
    let parts = (team.workers.len() + 1).min(count.max(1));
    let job = Job { work, count, parts };
    // SAFETY: only the lifetime is erased; `Finish` below waits, even while unwinding, until no worker can reach
    // the job any more (every part claimed and every claimed part finished) before this frame ends.
    let ptr = unsafe { std::mem::transmute::<*const Job<'_>, *mut Job<'static>>(&job) };
    team.job.store(ptr, Ordering::Relaxed);
    team.done.store(0, Ordering::Relaxed);
    team.panicked.store(false, Ordering::Relaxed);
    team.open.store(((1usize << parts) - 1) & !1, Ordering::SeqCst);
    for w in &team.workers[..parts - 1] {
        if w.sleeping.load(Ordering::SeqCst) {
            if let Some(t) = w.thread.get() {
                t.unpark();
            }
        }
    }
    let mut finish = Finish { team, own: 1, parts };
    work(part(count, parts, 0));
    // Parts no worker has claimed yet (asleep, or not yet back from its last part) are the caller's.
    for p in 1..parts {
        if team.open.fetch_and(!(1 << p), Ordering::AcqRel) & (1 << p) != 0 {
            finish.own += 1;
            work(part(count, parts, p));
        }
    }
    drop(finish);
    if team.panicked.swap(false, Ordering::Relaxed) {
        panic!("a part of a team product panicked");
    }
    true
}

/// Waits for the workers' parts and frees the team, when `spread` returns or unwinds.
struct Finish {
    team: &'static Team,
    own: usize,
    parts: usize,
}

impl Drop for Finish {
    fn drop(&mut self) {
        // Unwinding from the caller's own part: take the unclaimed parts away so no worker starts one.
        let unclaimed = self.team.open.swap(0, Ordering::AcqRel).count_ones() as usize;
        let workers = self.parts - self.own - unclaimed;
        while self.team.done.load(Ordering::Acquire) < workers {
            std::hint::spin_loop();
        }
        self.team.busy.store(false, Ordering::Release);
    }
}

impl Team {
    /// Member `member`'s loop: wait for its part to open, claim it, run it.
    fn serve(&self, member: usize) {
        let bit = 1usize << member;
        let me = &self.workers[member - 1];
        loop {
            self.wait_for(bit, me);
            if self.open.fetch_and(!bit, Ordering::AcqRel) & bit == 0 {
                continue; // the caller took it
            }
            // SAFETY: the part was open, so the job it belongs to is in flight and stays alive until `done` counts
            // this part (the caller's `Finish` waits for it).
            let job = unsafe { &*self.job.load(Ordering::Acquire) };
            let range = part(job.count, job.parts, member);
            if panic::catch_unwind(AssertUnwindSafe(|| (job.work)(range))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }

    /// Spin until `bit` is open: for `HOT`, then yielding the core to any other ready thread between looks, up to
    /// `spin()`; then sleep until a caller wakes this worker.
    fn wait_for(&self, bit: usize, me: &Worker) {
        let start = Instant::now();
        let mut spins = 0u32;
        while self.open.load(Ordering::Relaxed) & bit == 0 {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                continue;
            }
            let waited = start.elapsed();
            if waited < spin() {
                if waited >= HOT {
                    // Past the gaps inside a step: let any other thread ready on this core run first (the server's
                    // event loop, a client on the same machine), coming back for the next product after it.
                    thread::yield_now();
                }
                continue;
            }
            // A caller stores `open` before it reads `sleeping` (both SeqCst): either it sees this flag and
            // unparks, or this load sees its bit.
            me.sleeping.store(true, Ordering::SeqCst);
            if self.open.load(Ordering::SeqCst) & bit == 0 {
                thread::park();
            }
            // Woken: spin again, whether or not the caller has already taken the part it was woken for, so
            // that the step's next products find this worker awake.
            me.sleeping.store(false, Ordering::Relaxed);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_index_runs_once_whatever_the_pauses_between_calls() {
        for (round, count) in [1usize, 2, 3, 7, 64, 1000].into_iter().cycle().take(60).enumerate() {
            let hits: Vec<AtomicU64> = (0..count).map(|_| AtomicU64::new(0)).collect();
            let ran = spread(count, &|r: Range<usize>| r.for_each(|i| _ = hits[i].fetch_add(1, Ordering::Relaxed)));
            if !ran {
                (0..count).for_each(|i| _ = hits[i].fetch_add(1, Ordering::Relaxed));
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "count {count}");
            if round % 7 == 0 {
                thread::sleep(spin() * 3); // let the workers fall asleep
            }
        }
    }

    #[test]
    fn parts_are_contiguous_and_cover_the_range() {
        for parts in 1..5 {
            for count in 0..20 {
                let all: Vec<usize> = (0..parts).flat_map(|p| part(count, parts, p)).collect();
                assert_eq!(all, (0..count).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn a_thread_alone_and_a_second_caller_are_refused() {
        if team().is_none() {
            return;
        }
        assert!(!alone(|| spread(4, &|_| ())));
        assert!(!ALONE.get(), "alone restores the flag");
        let nested_ran = AtomicBool::new(false);
        spread_now(4, &|_| _ = nested_ran.fetch_or(spread(4, &|_| ()), Ordering::Relaxed));
        assert!(!nested_ran.load(Ordering::Relaxed));
    }

    /// `spread` retried while another test holds the team.
    fn spread_now(count: usize, work: &(dyn Fn(Range<usize>) + Sync)) {
        while !spread(count, work) {
            thread::yield_now();
        }
    }

    #[test]
    fn a_panicking_part_is_raised_in_the_caller_and_the_team_serves_on() {
        if team().is_none() {
            return;
        }
        for _ in 0..20 {
            let caught = panic::catch_unwind(|| spread_now(8, &|r: Range<usize>| assert!(!r.contains(&7), "part 7")));
            assert!(caught.is_err());
            let sum = AtomicU64::new(0);
            spread_now(10, &|r: Range<usize>| _ = sum.fetch_add(r.map(|i| i as u64).sum(), Ordering::Relaxed));
            assert_eq!(sum.load(Ordering::Relaxed), 45);
        }
    }
}
