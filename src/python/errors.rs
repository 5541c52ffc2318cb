//! The one conversion from the crate's [`Error`] to a Python exception.
use pyo3::PyErr;
use pyo3::exceptions::{PyLookupError, PyRuntimeError, PyTimeoutError, PyValueError};

use crate::error::Error;

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        let msg = err.to_string();
        match err {
            Error::InvalidKnob { .. }
            | Error::InvalidInput(_)
            | Error::UnsupportedHashAlgo(_)
            | Error::InvalidProfile { .. } => PyValueError::new_err(msg),
            Error::Timeout { .. } => PyTimeoutError::new_err(msg),
            Error::StaleHandle(_) => PyLookupError::new_err(msg),
            _ => PyRuntimeError::new_err(msg),
        }
    }
}
