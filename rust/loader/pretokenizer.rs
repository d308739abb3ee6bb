//! The pre-tokenizers a file may name (`tokenizer.ggml.pre`): how text is split into words before BPE merges them.

/// The pre-tokenizer (`tokenizer.ggml.pre`, llama.cpp's names): the regex that splits text into words before BPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    Gpt2,
    /// Qwen2's: contractions in any case, a letter run with one leading non-letter, single digits.
    Qwen2,
    /// Llama 3's: Qwen2's with digits in runs of up to three.
    Llama3,
    /// SmolLM's (Ouro's tokenizer): every digit split off on its own, then GPT-2's regex within each piece.
    Smollm,
}

impl PreTokenizer {
    pub const NAMES: [(&'static str, PreTokenizer); 4] =
        [("gpt-2", Self::Gpt2), ("qwen2", Self::Qwen2), ("llama-bpe", Self::Llama3), ("smollm", Self::Smollm)];

    pub fn from_name(name: &str) -> Option<Self> {
        Self::NAMES.iter().find(|(n, _)| *n == name).map(|(_, p)| *p)
    }

    /// Whether text is NFC-normalized before it is split: Qwen2's tokenizer normalizes, and a converted checkpoint
    /// names "qwen2" only with that normalizer.
    pub fn nfc(self) -> bool {
        self == Self::Qwen2
    }

    /// Whether every digit is split off before the regex runs (SmolLM's `Digits(individual_digits)` step).
    pub fn split_digits(self) -> bool {
        self == Self::Smollm
    }

    /// The regex that splits text (within each piece of the digit split, for SmolLM's).
    pub fn pattern(self) -> &'static str {
        match self {
            Self::Gpt2 | Self::Smollm => {
                r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"
            }
            Self::Qwen2 => {
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            }
            Self::Llama3 => {
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            }
        }
    }
}
