//! The generation layer on the shipped default model, without Python: a batched step is each generator's solo step,
//! chain and tree speculation give plain greedy output (tree verification keeps the longest accepted path, so it
//! accepts at least as much as the chain), and a prefix the prompt cache restores — from memory or from its
//! directory — gives the output of a fresh prefill, while a damaged file there is refused, not used.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{step_batch, Engine, Generation, Generator, PromptCache, Speculative};
use crate::sampler::SamplingParams;

const MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/python/tinyloop/models/default.tinyloop");

fn engine(cache: PromptCache) -> Engine {
    let mut e = Engine::load(Path::new(MODEL), Some(512)).expect("the shipped default model loads");
    e.set_prompt_cache(cache).expect("the prompt cache is configured");
    e
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens, ignore_eos: true, ..SamplingParams::default() }
}

fn prompt(e: &Engine, text: &str) -> Vec<u32> {
    e.tokenizer.encode_text(text, false, true).expect("the prompt encodes")
}

fn run(e: &Arc<Engine>, ids: &[u32], g: Generation) -> Generator {
    let mut gen = Generator::new(e.clone(), ids.to_vec(), g).expect("a valid generation");
    gen.run().expect("it runs to its end");
    gen
}

fn plain(loops: usize, max_tokens: usize) -> Generation {
    Generation { params: greedy(max_tokens), loops: Some(loops), ..Generation::default() }
}

fn drafted(k_branches: usize, max_tokens: usize) -> Generation {
    let spec = Speculative { draft_loops: 2, verify_loops: 8, draft_ahead: 4, k_branches };
    Generation { params: greedy(max_tokens), speculative: Some(spec), ..Generation::default() }
}

#[test]
fn a_batched_step_is_each_generators_solo_step() {
    let e = Arc::new(engine(PromptCache::default()));
    let asks = [
        (prompt(&e, "Once upon a time"), plain(8, 24)),
        (prompt(&e, "The sea was calm and the boat"), plain(3, 17)),
        (prompt(&e, "User: Hi\nAssistant:"), drafted(1, 20)),
        (prompt(&e, "A"), Generation { params: SamplingParams { seed: Some(7), ..greedy(12) }, ..plain(5, 12) }),
    ];
    let solo: Vec<Vec<u32>> = asks.iter().map(|(p, g)| run(&e, p, g.clone()).output().to_vec()).collect();
    let mut gens: Vec<Generator> =
        asks.iter().map(|(p, g)| Generator::new(e.clone(), p.clone(), g.clone()).unwrap()).collect();
    for _ in 0..200 {
        let mut live: Vec<&mut Generator> = gens.iter_mut().filter(|g| g.finish().is_none()).collect();
        if live.is_empty() {
            break;
        }
        for step in step_batch(&mut live) {
            step.expect("a batched step");
        }
    }
    let batched: Vec<Vec<u32>> = gens.iter().map(|g| g.output().to_vec()).collect();
    assert!(gens.iter().all(|g| g.finish().is_some()), "every generator ended");
    assert_eq!(batched, solo);
    assert_eq!(batched.iter().map(Vec::len).collect::<Vec<_>>(), [24, 17, 20, 12]);
}

#[test]
fn chain_and_tree_speculation_give_plain_greedy_output() {
    let e = Arc::new(engine(PromptCache::default()));
    let ids = prompt(&e, "User: Tell me about the sea.\nAssistant:");
    let want = run(&e, &ids, plain(8, 48)).output().to_vec();
    let chain = run(&e, &ids, drafted(1, 48));
    let tree = run(&e, &ids, drafted(3, 48));
    assert_eq!(chain.output(), want.as_slice());
    assert_eq!(tree.output(), want.as_slice());
    let (c, t) = (chain.draft(), tree.draft());
    assert!(c.accepted > 0, "the chain's drafts are accepted some of the time: {c:?}");
    // Three candidates per depth, the longest accepted path kept: never fewer tokens accepted than the one chain.
    assert!(t.accepted >= c.accepted && t.rounds <= c.rounds, "tree {t:?} against chain {c:?}");
}

/// The next turn's prompt: the first turn's prompt and answer, then a new question.
fn follow_up(e: &Engine, ids: &[u32], first: &Generator) -> Vec<u32> {
    let mut ids = ids.to_vec();
    ids.extend_from_slice(first.output());
    ids.extend(prompt(e, "\nUser: And then?\nAssistant:"));
    ids
}

#[test]
fn a_prefix_restored_from_memory_gives_a_fresh_prefills_output() {
    let fresh = Arc::new(engine(PromptCache::default()));
    let cached = Arc::new(engine(PromptCache { max_bytes: 64 << 20, max_entries: 4, disk: None }));
    let ids = prompt(&cached, "User: Hi there.\nAssistant:");
    let first = run(&cached, &ids, plain(8, 16));
    let next = follow_up(&cached, &ids, &first);
    drop(first); // a finished generator offers its KV to the prompt cache
    let reused = run(&cached, &next, plain(8, 16));
    assert!(reused.cached_tokens() > ids.len() / 2, "the prefix was reused: {} tokens", reused.cached_tokens());
    assert_eq!(reused.output(), run(&fresh, &next, plain(8, 16)).output());
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tinyloop-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn on_disk(dir: &Path) -> PromptCache {
    // A restarted engine's memory is empty: what it reuses comes from the directory.
    PromptCache { max_bytes: 64 << 20, max_entries: 4, disk: Some((dir.to_path_buf(), 64 << 20)) }
}

#[test]
fn a_prefix_from_disk_is_used_and_a_damaged_file_is_refused() {
    let dir = scratch("prefix-disk");
    let fresh = Arc::new(engine(PromptCache::default()));
    let ids;
    let next;
    {
        let writer = Arc::new(engine(on_disk(&dir)));
        ids = prompt(&writer, "User: Where is the boat?\nAssistant:");
        let first = run(&writer, &ids, plain(8, 16));
        next = follow_up(&writer, &ids, &first);
        drop(first);
        writer.prefixes.flush();
    }
    let want = run(&fresh, &next, plain(8, 16)).output().to_vec();
    let restarted = Arc::new(engine(on_disk(&dir)));
    let reused = run(&restarted, &next, plain(8, 16));
    assert!(reused.cached_tokens() > ids.len() / 2, "read back: {} tokens", reused.cached_tokens());
    assert_eq!(reused.output(), want.as_slice());
    drop(reused);
    drop(restarted);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
        // truncated
    }
    let damaged = Arc::new(engine(on_disk(&dir)));
    let again = run(&damaged, &next, plain(8, 16));
    assert_eq!(again.cached_tokens(), 0, "a truncated file is not used");
    assert_eq!(again.output(), want.as_slice());
    let _ = std::fs::remove_dir_all(&dir);
}
