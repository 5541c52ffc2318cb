//! Reading a prompt's token ids from Python, with errors that name the offending position.
//!
//! Two forms are accepted: a `list`/`tuple` of ints (what OpenAI-style callers have), and a
//! bytes-like object of packed little-endian `uint32` (what `EngineProbe` sends: msgpack carries
//! it as one binary blob, so neither side converts thousands of Python ints inside the engine loop).
use std::borrow::Cow;

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyTuple};

use crate::error::Error;

/// Limits a prompt must respect: the engine's vocabulary and context length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TokenLimits {
    pub(crate) vocab_size: u64,
    pub(crate) max_model_len: usize,
}

/// Extracts and validates `obj` as a prompt (non-empty, ids in `0..vocab_size`, length within
/// `max_model_len`). `limits = None` skips the engine-specific checks (used by the hash helpers).
pub(crate) fn read_prompt<'a>(
    obj: &'a Bound<'_, PyAny>,
    limits: Option<TokenLimits>,
) -> Result<Cow<'a, [u32]>, Error> {
    let tokens: Cow<'a, [u32]> = if let Ok(b) = obj.cast::<PyBytes>() {
        borrow_le_u32(b.as_bytes())?
    } else if let Ok(b) = obj.cast::<PyByteArray>() {
        // SAFETY-free copy: `to_vec` snapshots the buffer while we hold the interpreter.
        Cow::Owned(unpack_le_u32(&b.to_vec())?)
    } else if let Ok(list) = obj.cast::<PyList>() {
        Cow::Owned(read_ints(list.iter(), list.len())?)
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        Cow::Owned(read_ints(tuple.iter(), tuple.len())?)
    } else {
        return Err(Error::InvalidInput(format!(
            "token_ids must be a list of ints or packed little-endian uint32 bytes, got {}",
            type_name(obj)
        )));
    };
    if let Some(limits) = limits {
        check_limits(&tokens, limits)?;
    }
    Ok(tokens)
}

fn check_limits(tokens: &[u32], limits: TokenLimits) -> Result<(), Error> {
    check_length(tokens, limits)?;
    check_vocab(tokens, 0, limits)
}

/// The O(1) half of the limits: non-empty, and no longer than `max_model_len`.
pub(crate) fn check_length(tokens: &[u32], limits: TokenLimits) -> Result<(), Error> {
    if tokens.is_empty() {
        return Err(Error::InvalidInput("token_ids is empty".into()));
    }
    if tokens.len() > limits.max_model_len {
        return Err(Error::InvalidInput(format!(
            "prompt has {} tokens, longer than max_model_len {}",
            tokens.len(),
            limits.max_model_len
        )));
    }
    Ok(())
}

/// Every id of `tokens` is inside the vocabulary; `tokens` starts at index `offset` of the
/// prompt (errors name the prompt's index).
pub(crate) fn check_vocab(tokens: &[u32], offset: usize, limits: TokenLimits) -> Result<(), Error> {
    // A branch-free pass first (the largest id, vectorised); the position is only searched for
    // when there is something to report.
    if u64::from(max_token(tokens)) < limits.vocab_size {
        return Ok(());
    }
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| u64::from(t) >= limits.vocab_size)
    {
        return Err(Error::InvalidInput(format!(
            "token id {t} at index {} is outside the vocabulary (size {})",
            offset + i,
            limits.vocab_size
        )));
    }
    Ok(())
}

/// The largest id in `tokens` (0 if empty). With AVX2 (checked at run time; the wheel targets
/// plain x86-64) eight ids a step: a 32K-token prompt in well under a microsecond, where the
/// SSE2 build's emulated unsigned compares took a few inside the engine loop.
fn max_token(tokens: &[u32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { max_token_avx2(tokens) };
    }
    max_token_portable(tokens)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn max_token_avx2(tokens: &[u32]) -> u32 {
    max_token_portable(tokens)
}

#[inline(always)]
fn max_token_portable(tokens: &[u32]) -> u32 {
    tokens.iter().fold(0, |max, &t| max.max(t))
}

/// `bytes` as packed little-endian `u32`s, borrowed in place when the buffer is 4-byte aligned on
/// a little-endian machine (a Python bytes object's buffer is): a 32K-token prompt is then read
/// without copying its 128 KB.
fn borrow_le_u32(bytes: &[u8]) -> Result<Cow<'_, [u32]>, Error> {
    #[cfg(target_endian = "little")]
    if bytes.len().is_multiple_of(4) {
        // SAFETY: every bit pattern is a valid `u32`, and `align_to` only yields the middle part
        // at a properly aligned address; on a little-endian machine it is the same values.
        let (head, words, tail) = unsafe { bytes.align_to::<u32>() };
        if head.is_empty() && tail.is_empty() {
            return Ok(Cow::Borrowed(words));
        }
    }
    unpack_le_u32(bytes).map(Cow::Owned)
}

fn unpack_le_u32(bytes: &[u8]) -> Result<Vec<u32>, Error> {
    if !bytes.len().is_multiple_of(4) {
        return Err(Error::InvalidInput(format!(
            "packed token_ids must be a multiple of 4 bytes (little-endian uint32), got {} bytes",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn read_ints<'py>(
    items: impl Iterator<Item = Bound<'py, PyAny>>,
    len: usize,
) -> Result<Vec<u32>, Error> {
    let mut out = Vec::with_capacity(len);
    for (i, item) in items.enumerate() {
        // bool is an int subclass in Python; a True in a prompt is a caller bug, not token 1.
        if item.is_instance_of::<pyo3::types::PyBool>() {
            return Err(Error::InvalidInput(format!(
                "token id at index {i} is a bool, expected int"
            )));
        }
        let value: i64 = match item.extract::<i64>() {
            Ok(v) => v,
            Err(_) if item.is_instance_of::<pyo3::types::PyInt>() => {
                return Err(Error::InvalidInput(format!(
                    "token id at index {i} does not fit in 64 bits"
                )));
            }
            Err(_) => {
                return Err(Error::InvalidInput(format!(
                    "token id at index {i} is {}, expected int",
                    type_name(&item)
                )));
            }
        };
        let Ok(token) = u32::try_from(value) else {
            return Err(Error::InvalidInput(format!(
                "token id {value} at index {i} is {}",
                if value < 0 {
                    "negative"
                } else {
                    "larger than 2^32-1"
                }
            )));
        };
        out.push(token);
    }
    Ok(out)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "an unknown type".into())
}
