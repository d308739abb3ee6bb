//! The model's vocabulary as llguidance sees it: a token trie over each id's bytes, and the model's own BPE for
//! the (rare) text llguidance tokenizes itself.

use std::sync::Arc;

use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::Tokenizer;

pub(super) struct Vocab {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl Vocab {
    /// Ids the tokenizer does not know (a model vocabulary padded past it) and ids whose bytes start with 0xFF
    /// (which llguidance reserves as the marker of special tokens, and which valid UTF-8 never contains) get no
    /// bytes, so no grammar ever allows them. Control tokens are spelled as llguidance expects: 0xFF, then the text.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize) -> Self {
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match tokenizer.token_bytes(id) {
                Ok(b) if tokenizer.is_control(id) => [&[TokTrie::SPECIAL_TOKEN_MARKER], b].concat(),
                Ok(b) if b.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(vocab_size as u32, tokenizer.eos_token_id);
        Self { trie: TokTrie::from(&info, &words), tokenizer }
    }
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Text is tokenized as the model's BPE would (special-token text stays text); bytes that are not UTF-8 are
    /// split greedily along the trie.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s).map(|t| self.tokenizer.encode(t, false)) {
            Ok(Ok(ids)) => ids,
            _ => self.trie.greedy_tokenize(s),
        }
    }
}
