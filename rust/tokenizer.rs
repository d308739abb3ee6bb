//! Byte-level BPE (GPT-2's, and the same scheme as Qwen2's and Llama 3's) built from the model file's `tokens` /
//! `token_type` / `merges`, split before merging by the pre-tokenizer the file names.
//!
//! The BPE itself is tiktoken's algorithm (`tiktoken-rs`), which merges by rank. GPT-2's merge list and its ranks
//! agree when each merge's result has a larger id than the results of all earlier merges, so the loader checks
//! exactly that and uses ids as ranks. Control tokens (type 3, e.g. `<|endoftext|>`) are special tokens: they are
//! recognised in text only when the caller asks for it.

use std::collections::{HashMap, HashSet};

use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;
// `tokenizers`' own NFC (its Unicode tables, so code points a newer Unicode assigned normalize as they do there).
use unicode_normalization_alignments::{is_nfc, UnicodeNormalization};

use crate::error::{Error, Result};
use crate::limits::MAX_CONTROL_TOKENS;
use crate::loader::VocabData;

const TOKEN_TYPE_CONTROL: i64 = 3;

pub struct Tokenizer {
    bpe: CoreBPE,
    /// id -> bytes, for every id (special tokens as their UTF-8 text).
    bytes: Vec<Vec<u8>>,
    specials: Vec<String>,
    /// Ids of the control tokens, ascending.
    control_ids: Vec<u32>,
    /// Text is NFC-normalized before it is split (Qwen2's tokenizer does: `PreTokenizer::nfc`).
    nfc: bool,
    /// SmolLM's pre-tokenizer: each digit is a piece of its own before the regex (`PreTokenizer::split_digits`);
    /// then control tokens are found here (`specials_re`, longest first) rather than by tiktoken.
    split_digits: bool,
    specials_re: Option<regex::Regex>,
    special_ids: FxHashMap<String, u32>,
    pub eos_token_id: u32,
    /// Every token that ends generation as end-of-sequence does: `eos_token_id` first, then the file's others.
    pub end_ids: Vec<u32>,
    pub bos_token_id: u32,
    /// Whether a prompt of plain text starts with `bos_token_id` (Llama's tokenizers add it; GPT-2's and Qwen2's
    /// do not).
    pub add_bos_token: bool,
}

/// GPT-2's printable-unicode spelling of bytes, inverted: char -> byte.
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut printable: Vec<u32> = (u32::from('!')..=u32::from('~')).collect();
    printable.extend(u32::from('¡')..=u32::from('¬'));
    printable.extend(u32::from('®')..=u32::from('ÿ'));
    let mut map: HashMap<char, u8> = printable.iter().map(|&c| (char::from_u32(c).unwrap_or('\0'), c as u8)).collect();
    let mut extra = 0u32;
    for b in 0u32..256 {
        if !printable.contains(&b) {
            map.insert(char::from_u32(256 + extra).unwrap_or('\0'), b as u8);
            extra += 1;
        }
    }
    map
}

/// Register control token `id`. An empty one would match everywhere without advancing (tiktoken's encode then
/// loops forever when special tokens are allowed); two with the same text would make one of them unreachable.
fn add_control(specials: &mut FxHashMap<String, u32>, tok: &str, id: u32) -> Result<()> {
    if tok.is_empty() {
        return Err(Error::Tokenizer(format!("control token {id} is empty")));
    }
    if let Some(prev) = specials.insert(tok.to_string(), id) {
        return Err(Error::Tokenizer(format!("control tokens {prev} and {id} are both {tok:?}")));
    }
    if specials.len() > MAX_CONTROL_TOKENS {
        return Err(Error::Tokenizer(format!("more than {MAX_CONTROL_TOKENS} control tokens")));
    }
    Ok(())
}

impl Tokenizer {
    pub fn from_vocab(v: &VocabData) -> Result<Self> {
        let table = unicode_to_byte();
        let spell = |s: &str| -> Result<Vec<u8>> {
            s.chars()
                .map(|c| {
                    table.get(&c).copied().ok_or_else(|| {
                        Error::Tokenizer(format!("token {s:?} has character {c:?} outside GPT-2's byte alphabet"))
                    })
                })
                .collect()
        };
        let mut encoder: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
        let mut specials_map: FxHashMap<String, u32> = FxHashMap::default();
        let mut bytes = Vec::with_capacity(v.tokens.len());
        let mut control_ids = Vec::new();
        for (id, (tok, ty)) in v.tokens.iter().zip(&v.token_types).enumerate() {
            let id = id as u32;
            if *ty == TOKEN_TYPE_CONTROL {
                add_control(&mut specials_map, tok, id)?;
                control_ids.push(id);
                bytes.push(tok.as_bytes().to_vec());
            } else {
                let b = spell(tok)?;
                if b.is_empty() {
                    return Err(Error::Tokenizer(format!("token {id} is empty")));
                }
                if let Some(prev) = encoder.insert(b.clone(), id) {
                    return Err(Error::Tokenizer(format!("tokens {prev} and {id} spell the same bytes")));
                }
                bytes.push(b);
            }
        }
        for b in 0..=255u8 {
            if !encoder.contains_key(&vec![b]) {
                return Err(Error::Tokenizer(format!("byte {b:#04x} has no token")));
            }
        }
        // Merges must be consistent with using ids as ranks.
        let mut last = 0u32;
        for (i, m) in v.merges.iter().enumerate() {
            let (a, b) =
                m.split_once(' ').ok_or_else(|| Error::Tokenizer(format!("merge {i} {m:?} is not \"left right\"")))?;
            let mut joined = spell(a)?;
            joined.extend(spell(b)?);
            let id =
                *encoder.get(&joined).ok_or_else(|| Error::Tokenizer(format!("merge {i} {m:?} makes no token")))?;
            if id <= last && i > 0 {
                return Err(Error::Tokenizer(format!(
                    "merge {i} {m:?} makes token {id}, not after {last}: ranks must follow ids"
                )));
            }
            last = id;
        }
        let mut specials: Vec<String> = specials_map.keys().cloned().collect();
        specials.sort_by_key(|t| std::cmp::Reverse(t.len()));
        let alternatives: Vec<String> = specials.iter().map(|t| regex::escape(t)).collect();
        let specials_re = match specials.is_empty() {
            true => None,
            false => Some(regex::Regex::new(&alternatives.join("|")).map_err(|e| Error::Tokenizer(e.to_string()))?),
        };
        let special_ids = specials_map.clone();
        let bpe = CoreBPE::new(encoder, specials_map, v.pre.pattern()).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut end_ids = vec![v.eos_token_id];
        end_ids.extend(v.end_ids.iter().filter(|&&t| t != v.eos_token_id));
        Ok(Self {
            bpe,
            bytes,
            specials,
            control_ids,
            nfc: v.pre.nfc(),
            split_digits: v.pre.split_digits(),
            specials_re,
            special_ids,
            eos_token_id: v.eos_token_id,
            end_ids,
            bos_token_id: v.bos_token_id,
            add_bos_token: v.add_bos_token,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// True for a control token (type 3, e.g. `<|endoftext|>`): its bytes are its name, not text.
    pub fn is_control(&self, id: u32) -> bool {
        self.control_ids.binary_search(&id).is_ok()
    }

    /// Encode text; special-token text is encoded as ordinary text unless `allow_special`.
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>> {
        let allowed: HashSet<&str> =
            if allow_special { self.specials.iter().map(String::as_str).collect() } else { HashSet::new() };
        let normalized: String;
        let text = if self.nfc && !is_nfc(text) {
            normalized = text.nfc().map(|(c, _)| c).collect();
            normalized.as_str()
        } else {
            text
        };
        if self.split_digits {
            return Ok(self.encode_digits_apart(text, allow_special));
        }
        self.bpe.encode(text, &allowed).map(|(ids, _)| ids).map_err(|e| Error::Tokenizer(e.message))
    }

    /// `encode` for a pre-tokenizer that splits every digit off first: control tokens (when allowed), then the
    /// text between them in pieces — each digit alone, each run of other characters — each split by the regex.
    fn encode_digits_apart(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let found = self.specials_re.as_ref().filter(|_| allow_special).and_then(|re| re.find(rest));
            let plain = found.map_or(rest, |m| &rest[..m.start()]);
            let mut start = 0;
            for (i, c) in plain.char_indices() {
                if c.is_numeric() {
                    out.extend(self.bpe.encode_ordinary(&plain[start..i]));
                    out.extend(self.bpe.encode_ordinary(&plain[i..i + c.len_utf8()]));
                    start = i + c.len_utf8();
                }
            }
            out.extend(self.bpe.encode_ordinary(&plain[start..]));
            match found {
                Some(m) => {
                    out.extend(self.special_ids.get(m.as_str()));
                    rest = &rest[m.end()..];
                }
                None => break,
            }
        }
        out
    }

    /// `encode`, with the beginning-of-sequence token first when the file says prompts start with it and
    /// `add_special` asks for the tokens a tokenizer puts around a text.
    pub fn encode_text(&self, text: &str, allow_special: bool, add_special: bool) -> Result<Vec<u32>> {
        let ids = self.encode(text, allow_special)?;
        Ok(match add_special && self.add_bos_token {
            true => std::iter::once(self.bos_token_id).chain(ids).collect(),
            false => ids,
        })
    }

    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        self.bytes.get(id as usize).map(Vec::as_slice).ok_or_else(|| {
            Error::InvalidArgument(format!("token id {id} is outside the {}-token vocabulary", self.bytes.len()))
        })
    }

    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(out)
    }

    /// Decode to text; invalid UTF-8 (a sequence cut mid-character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The 256 byte tokens, then `controls` (type 3); no merges.
    pub(crate) fn vocab(controls: &[&str]) -> VocabData {
        let mut by_byte: Vec<(u8, char)> = unicode_to_byte().into_iter().map(|(c, b)| (b, c)).collect();
        by_byte.sort();
        let mut tokens: Vec<String> = by_byte.iter().map(|(_, c)| c.to_string()).collect();
        tokens.extend(controls.iter().map(|s| s.to_string()));
        let token_types = (0..tokens.len()).map(|i| if i < 256 { 1 } else { TOKEN_TYPE_CONTROL }).collect();
        VocabData { tokens, token_types, ..VocabData::empty() }
    }

    fn error(controls: &[&str]) -> String {
        match Tokenizer::from_vocab(&vocab(controls)) {
            Ok(_) => panic!("accepted {} control tokens", controls.len()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn control_tokens_round_trip() {
        let t = Tokenizer::from_vocab(&vocab(&["<|endoftext|>", "<x>"])).unwrap();
        let text = "a<x>\0é<|endoftext|>";
        let ids = t.encode(text, true).unwrap();
        assert!(ids.contains(&256) && ids.contains(&257));
        assert_eq!(t.decode(&ids).unwrap(), text);
        assert_eq!(t.decode(&t.encode(text, false).unwrap()).unwrap(), text);
        assert!(t.decode(&[258]).is_err() && t.token_bytes(u32::MAX).is_err());
    }

    #[test]
    fn empty_duplicate_or_too_many_control_tokens_are_refused() {
        assert!(error(&[""]).contains("control token 256 is empty"));
        assert!(error(&["<a>", "<b>", "<a>"]).contains("control tokens 256 and 258 are both \"<a>\""));
        let many: Vec<String> = (0..=MAX_CONTROL_TOKENS).map(|i| format!("<{i}>")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(error(&many).contains("more than 1024 control tokens"));
        assert!(Tokenizer::from_vocab(&vocab(&many[1..])).is_ok());
    }
}
