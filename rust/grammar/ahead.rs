//! Computing the next mask while the model computes the next logits.
//!
//! As soon as a token is emitted, the matcher holds everything the next mask depends on, but the sampler needs
//! that mask only after the next forward pass. `Workers::start` hands the matcher to the engine's grammar threads
//! (their own threads: the forward pass keeps the engine's pool) and `Lookahead::finish` takes it back.
//! If no grammar thread has started the job by then, the caller does it itself, so a caller never waits for a
//! queued job, whatever thread it runs on — a pool thread of the engine included — and a busy machine costs no
//! more than computing the mask inline.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};

use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

/// The mask for the matcher's current state, or why it could not be computed.
pub type Mask = std::result::Result<SimpleVob, String>;

pub fn compute(matcher: &mut Matcher) -> Mask {
    matcher.compute_mask_or_eos().map_err(|e| e.to_string())
}

enum Stage {
    Queued(Box<Matcher>),
    Running,
    Done(Box<Matcher>, Mask),
    /// Taken back (or abandoned) before a grammar thread reached it.
    Taken,
}

/// A matcher away on a grammar thread, computing its next mask.
pub struct Lookahead {
    stage: Mutex<Stage>,
    done: Condvar,
}

impl Lookahead {
    fn queued(matcher: Box<Matcher>) -> Arc<Self> {
        Arc::new(Self { stage: Mutex::new(Stage::Queued(matcher)), done: Condvar::new() })
    }

    /// The matcher back, with its mask when one was computed: by a grammar thread (waiting for it if it is
    /// running), or here if it had not started and `want_mask` — otherwise the job is dropped unstarted.
    pub fn finish(&self, want_mask: bool) -> (Box<Matcher>, Option<Mask>) {
        let mut stage = self.stage.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match std::mem::replace(&mut *stage, Stage::Taken) {
                Stage::Queued(mut m) => {
                    drop(stage);
                    let mask = want_mask.then(|| compute(&mut m));
                    return (m, mask);
                }
                Stage::Done(m, mask) => return (m, Some(mask)),
                Stage::Running => {
                    *stage = Stage::Running;
                    stage = self.done.wait(stage).unwrap_or_else(|p| p.into_inner());
                }
                Stage::Taken => unreachable!("a lookahead is finished once"),
            }
        }
    }

    /// Neither queued nor running nor done: taken back, or abandoned before it ran.
    #[cfg(test)]
    pub(super) fn is_taken(&self) -> bool {
        matches!(*self.stage.lock().unwrap(), Stage::Taken)
    }

    /// Give up on an unstarted job (its request ended); a running one completes and is dropped.
    pub fn abandon(&self) {
        let mut stage = self.stage.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*stage, Stage::Queued(_)) {
            *stage = Stage::Taken;
        }
    }

    /// On a grammar thread: compute the mask unless the owner took the matcher back first.
    pub(super) fn run(&self) {
        let mut stage = self.stage.lock().unwrap_or_else(|p| p.into_inner());
        let Stage::Queued(mut m) = std::mem::replace(&mut *stage, Stage::Running) else {
            *stage = Stage::Taken;
            return;
        };
        drop(stage);
        let mask = compute(&mut m);
        *self.stage.lock().unwrap_or_else(|p| p.into_inner()) = Stage::Done(m, mask);
        self.done.notify_all();
    }
}

/// An engine's grammar threads. They end when the engine and its requests' constraints, which hold the queue's
/// senders, are gone.
#[derive(Clone)]
pub struct Workers {
    /// None with no grammar threads: every mask is computed by the thread that needs it.
    queue: Option<Sender<Arc<Lookahead>>>,
    /// Jobs sent and not yet run; at most one per thread. With more streams than threads (a large batch) the rest
    /// of the masks are computed by the sampling threads, in parallel: a longer queue would only make the grammar
    /// threads compete with the forward pass for the same cores.
    in_flight: Arc<AtomicUsize>,
    threads: usize,
}

impl Workers {
    pub fn new(threads: usize) -> Self {
        let in_flight = Arc::new(AtomicUsize::new(0));
        if threads == 0 {
            return Self { queue: None, in_flight, threads };
        }
        let (tx, rx) = channel::<Arc<Lookahead>>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let (rx, in_flight) = (rx.clone(), in_flight.clone());
            // A thread that cannot start leaves its share of the jobs to their owners, who compute them inline.
            let _ =
                std::thread::Builder::new().name(format!("tinyloop-grammar-{i}")).spawn(move || serve(&rx, &in_flight));
        }
        Self { queue: Some(tx), in_flight, threads }
    }

    /// Send `matcher` away to compute its next mask, if a grammar thread is free to take it.
    pub fn start(&self, matcher: Box<Matcher>) -> Arc<Lookahead> {
        let job = Lookahead::queued(matcher);
        if let Some(queue) = &self.queue {
            if self.in_flight.fetch_add(1, Ordering::AcqRel) < self.threads {
                // With no grammar thread left to take it, the job stays queued and `finish` computes the mask.
                let _ = queue.send(job.clone());
            } else {
                self.in_flight.fetch_sub(1, Ordering::AcqRel);
            }
        }
        job
    }
}

/// As many grammar threads as cores, at most four: a mask takes tens to hundreds of microseconds.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(4)
}

fn serve(rx: &Mutex<Receiver<Arc<Lookahead>>>, in_flight: &AtomicUsize) {
    loop {
        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(job) => job,
            Err(_) => return,
        };
        job.run();
        in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}
