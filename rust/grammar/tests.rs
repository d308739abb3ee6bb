use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::kernels::logits::argmax;
use crate::tokenizer::tests::vocab;

/// Byte tokens 0..=255, `<|endoftext|>` (EOS) at 256, and three ids past the tokenizer (a padded model vocabulary).
const EOS: u32 = 256;
const VOCAB: usize = 260;

fn grammars() -> Grammars {
    let mut v = vocab(&["<|endoftext|>"]);
    v.eos_token_id = EOS;
    Grammars::new(Arc::new(Tokenizer::from_vocab(&v).unwrap()), VOCAB)
}

fn compile(g: Grammar) -> Constraint {
    grammars().compile(&g).unwrap()
}

/// Random logits, masked: the ids past the tokenizer are never allowed, and something always is.
fn masked_row(c: &mut Constraint, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let mut logits: Vec<f32> = (0..VOCAB).map(|_| rng.random::<f32>() * 4.0).collect();
    c.mask(&mut logits);
    assert!(logits[EOS as usize + 1..].iter().all(|&l| l == f32::NEG_INFINITY));
    assert!(logits.iter().any(|l| l.is_finite()));
    logits
}

/// The argmax of random masked rows, until EOS or a complete grammar (`None` if neither within `n` tokens).
fn drive(c: &mut Constraint, seed: u64, n: usize) -> Option<Vec<u8>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&masked_row(c, &mut rng));
        if t == EOS {
            return Some(out);
        }
        c.consume(t);
        assert_eq!(c.error(), None);
        out.push(t as u8);
        if c.is_complete() {
            return Some(out);
        }
    }
    None
}

#[test]
fn random_logits_under_a_json_schema_give_documents_it_accepts() {
    let schema = r#"{"type": "object", "additionalProperties": false, "required": ["n", "ok", "tag"],
        "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 300},
                       "ok": {"type": "boolean"},
                       "tag": {"enum": ["red", "green"]}}}"#;
    for seed in 0..20 {
        let out = drive(&mut compile(Grammar::JsonSchema(schema.into())), seed, 200).expect("the document ended");
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        let obj = v.as_object().unwrap();
        assert_eq!(obj.len(), 3, "{v}");
        assert!((-5..=300).contains(&obj["n"].as_i64().unwrap()), "{v}");
        assert!(obj["ok"].is_boolean() && ["red", "green"].contains(&obj["tag"].as_str().unwrap()), "{v}");
        // Compact separators by default.
        assert_eq!(
            String::from_utf8(out).unwrap(),
            serde_json::to_string(&v).unwrap().replace(',', ", ").replace(':', ": ")
        );
    }
}

#[test]
fn a_regex_allows_eos_only_when_the_output_matches() {
    let mut c = compile(Grammar::Regex("[0-9]{2}-(ab|cd)".into()));
    let mut row = vec![0.0; VOCAB];
    for &b in b"12-a" {
        row.fill(0.0);
        c.mask(&mut row);
        assert_eq!(row[EOS as usize], f32::NEG_INFINITY);
        assert!(row[b as usize].is_finite() && row[b'x' as usize] == f32::NEG_INFINITY);
        c.consume(b as u32);
        assert!(!c.is_complete());
    }
    c.consume(u32::from(b'b'));
    assert!(c.is_complete() && c.error().is_none());
}

#[test]
fn rewinding_drafts_restores_the_mask() {
    let mut c = compile(Grammar::Lark("start: \"{\" NAME (\",\" NAME)* \"}\"\nNAME: /[a-z]+/".into()));
    for &b in b"{ab" {
        c.consume(u32::from(b));
    }
    let mask = |c: &mut Constraint| {
        let mut row = vec![0.0f32; VOCAB];
        c.mask(&mut row);
        row
    };
    let before = mask(&mut c);
    for &b in b",cd" {
        c.draft(u32::from(b), false);
    }
    let drafted = mask(&mut c);
    assert!(drafted[b'}' as usize].is_finite() && drafted[b',' as usize].is_finite());
    c.rewind_drafts();
    assert_eq!(mask(&mut c), before);
    // A draft outside the grammar stops the advance (later drafts are drawn unmasked) until the rewind.
    c.draft(u32::from(b'{'), false);
    assert_eq!(mask(&mut c), vec![0.0; VOCAB]);
    c.rewind_drafts();
    assert_eq!(mask(&mut c), before);
    assert_eq!(c.error(), None);
}

#[test]
fn a_drafted_end_of_text_leaves_the_matcher_where_it_was() {
    let mut c = compile(Grammar::Regex("a(b)?".into()));
    c.consume(u32::from(b'a'));
    c.draft(EOS, true);
    c.rewind_drafts();
    let mut row = vec![0.0f32; VOCAB];
    c.mask(&mut row);
    assert!(row[b'b' as usize].is_finite() && row[EOS as usize].is_finite(), "b and the end are still allowed");
    c.consume(u32::from(b'b'));
    assert!(c.is_complete());
}

/// Masks computed ahead on the grammar threads (or taken back and computed inline) equal masks computed by a
/// matcher that never leaves its thread, for many requests advancing at once on several threads.
#[test]
fn masks_computed_ahead_equal_masks_computed_inline() {
    let schema = r#"{"type": "array", "items": {"type": "object", "required": ["k", "v"], "additionalProperties": false,
        "properties": {"k": {"type": "string", "maxLength": 6}, "v": {"type": "integer"}}}, "maxItems": 3}"#;
    let mut g = grammars();
    g.set_threads(2);
    std::thread::scope(|s| {
        for seed in 0..8u64 {
            let g = &g;
            s.spawn(move || {
                let grammar = Grammar::JsonSchema(schema.into());
                let (mut ahead, mut inline) = (g.compile(&grammar).unwrap(), g.compile(&grammar).unwrap());
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                for _ in 0..120 {
                    let row = masked_row(&mut ahead, &mut rng);
                    let reference = ahead::compute(inline.matcher(false)).unwrap();
                    let allowed: Vec<bool> = row.iter().map(|l| l.is_finite()).collect();
                    let expected: Vec<bool> = (0..VOCAB as u32).map(|t| reference.is_allowed(t)).collect();
                    assert_eq!(allowed, expected);
                    let t = argmax(&row);
                    if t == EOS || ahead.is_complete() {
                        return;
                    }
                    ahead.consume(t);
                    inline.matcher(false).consume_token(t).unwrap();
                }
            });
        }
    });
}

/// A matcher for `a(b)?` that has consumed `a`: `b` and the end are allowed next.
fn after_a() -> Box<Matcher> {
    let mut c = compile(Grammar::Regex("a(b)?".into()));
    c.matcher(false).consume_token(u32::from(b'a')).unwrap();
    c.here.take().unwrap()
}

fn allowed(mask: Option<Mask>) -> Vec<u32> {
    let mask = mask.expect("a mask").unwrap();
    (0..=EOS).filter(|&t| mask.is_allowed(t)).collect()
}

#[test]
fn a_job_no_thread_started_is_done_by_its_owner_only_when_the_mask_is_wanted() {
    let none = Workers::new(0);
    assert!(none.start(after_a()).finish(false).1.is_none());
    assert_eq!(allowed(none.start(after_a()).finish(true).1), vec![u32::from(b'b'), EOS]);
}

#[test]
fn a_job_a_thread_ran_hands_back_its_mask_and_an_abandoned_one_is_skipped() {
    let none = Workers::new(0);
    let job = none.start(after_a());
    job.run();
    assert_eq!(allowed(job.finish(false).1), vec![u32::from(b'b'), EOS]);
    let job = none.start(after_a());
    job.abandon();
    job.run();
    assert!(job.is_taken());
}

#[test]
fn grammars_that_cannot_compile_are_refused_with_the_cause() {
    let error = |g: Grammar| match grammars().compile(&g) {
        Ok(_) => panic!("{g:?} compiled"),
        Err(e) => e.to_string(),
    };
    let unsupported = error(Grammar::JsonSchema(r#"{"type": "array", "uniqueItems": true}"#.into()));
    assert!(unsupported.contains("uniqueItems"), "{unsupported}");
    assert!(error(Grammar::JsonSchema("{not json".into())).contains("not JSON"));
    assert!(error(Grammar::Lark("start: undefined_rule".into())).contains("undefined_rule"));
    assert!(error(Grammar::Regex("(".into())).starts_with("invalid argument: grammar:"));
}
