//! One error type for the crate. Every failure a caller can cause (a bad file, a bad argument, a prompt too long)
//! is a typed variant; `py/errors.rs` maps each kind to its own Python exception.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("model file not found: {0}")]
    NotFound(PathBuf),

    #[error("{path}: not a GGUF file: {reason}")]
    NotGguf { path: PathBuf, reason: String },

    /// The file is GGUF but does not describe a valid tinyloop model; `what` names the key or tensor.
    #[error("{path}: {what}: {reason}")]
    Format { path: PathBuf, what: String, reason: String },

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("sequence too long: {needed} positions needed but the limit is {limit}")]
    ContextLength { needed: usize, limit: usize },

    /// The device asked for cannot be used: a build without its backend, or no such GPU or driver.
    #[error("{0}")]
    Device(String),

    #[error("engine error: {0}")]
    Internal(String),
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Internal(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for argument checks: `ensure!(cond, "message {}", x)`.
#[macro_export]
macro_rules! ensure_arg {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::Error::InvalidArgument(format!($($fmt)+)));
        }
    };
}
