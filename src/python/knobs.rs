//! The knob table for Python: `GateConfig` (the gate's knobs, validated by Rust; immutable) and
//! `knobs()` / `knob_from_env(name)`, both read off [`crate::gate::knobs::KNOBS`].
//!
//! Nothing here names a knob: keywords, attributes, `to_dict` and `repr` all walk the table, so a
//! new knob needs no change in this file.
use pyo3::exceptions::{PyAttributeError, PyKeyError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::guard::no_panic;
use crate::gate::GateConfig;
use crate::gate::knobs::{self as table, Home, KNOBS, Knob, Rule, Value};

/// The gate's knobs, validated by Rust; immutable once built.
#[pyclass(name = "GateConfig", module = "session_gate._native", frozen, eq)]
#[derive(Clone, PartialEq)]
pub(crate) struct PyGateConfig {
    inner: GateConfig,
}

/// A gate knob by its Python name.
fn gate_knob(name: &str) -> Option<&'static Knob> {
    table::knob(name).filter(|k| matches!(k.home, Home::GateConfig(_)))
}

/// A Python value as the knob's kind (floats for seconds and fractions, `int` for counts,
/// `str` for names); `None` only where the rule can be off.
fn value_from_py(knob: &Knob, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    Ok(match knob.rule {
        Rule::SecondsOrOff if obj.is_none() => Value::Off,
        Rule::Fraction | Rule::Seconds | Rule::PositiveSeconds | Rule::SecondsOrOff => {
            Value::Number(obj.extract()?)
        }
        Rule::Count => Value::Count(obj.extract()?),
        Rule::OneOf { .. } => knob.parse(&obj.extract::<String>()?)?,
    })
}

fn value_to_py<'py>(py: Python<'py>, value: Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Number(v) => v.into_pyobject(py)?.into_any(),
        Value::Count(v) => v.into_pyobject(py)?.into_any(),
        Value::Name(v) => v.into_pyobject(py)?.into_any(),
        Value::Off => py.None().into_bound(py),
    })
}

/// A value as Python's `repr` shows it.
fn value_repr(value: Value) -> String {
    match value {
        Value::Number(v) => format!("{v:?}"),
        Value::Count(v) => v.to_string(),
        Value::Name(v) => format!("'{v}'"),
        Value::Off => "None".to_string(),
    }
}

#[pymethods]
impl PyGateConfig {
    /// Knobs by keyword; an omitted knob (or `None`) keeps its default from the knob table.
    /// Invalid values raise `ValueError` naming knob and value; an unknown keyword `TypeError`.
    #[new]
    #[pyo3(signature = (**knobs))]
    fn new(knobs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        no_panic("GateConfig()", || {
            let mut inner = GateConfig::default();
            for (key, obj) in knobs.into_iter().flatten() {
                let name: String = key.extract()?;
                let knob = gate_knob(&name).ok_or_else(|| {
                    PyTypeError::new_err(format!(
                        "GateConfig() got an unexpected keyword argument '{name}'"
                    ))
                })?;
                if !obj.is_none() {
                    knob.set(&mut inner, value_from_py(knob, &obj)?)?;
                }
            }
            inner.validate()?;
            Ok(Self { inner })
        })
    }

    /// Defaults overridden by the `SESSION_GATE_*` environment variables, validated.
    #[staticmethod]
    fn from_env() -> PyResult<Self> {
        no_panic("GateConfig.from_env", || {
            Ok(Self {
                inner: GateConfig::from_env()?,
            })
        })
    }

    /// Each knob as an attribute (`config.high_watermark`).
    fn __getattr__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        match gate_knob(name).and_then(|k| k.get(&self.inner)) {
            Some(value) => value_to_py(py, value),
            None => Err(PyAttributeError::new_err(format!(
                "'GateConfig' object has no attribute '{name}'"
            ))),
        }
    }

    /// Every knob by name, e.g. for logging the configuration a run used.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for knob in table::gate_knobs() {
            if let Some(value) = knob.get(&self.inner) {
                d.set_item(knob.name, value_to_py(py, value)?)?;
            }
        }
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let fields: Vec<String> = table::gate_knobs()
            .filter_map(|k| Some(format!("{}={}", k.name, value_repr(k.get(&self.inner)?))))
            .collect();
        format!("GateConfig({})", fields.join(", "))
    }
}

impl PyGateConfig {
    /// The Rust knobs, for other bindings that run a gate core.
    pub(crate) fn inner(&self) -> &GateConfig {
        &self.inner
    }

    /// Wraps Rust knobs (e.g. the ones a core runs with).
    pub(crate) fn new_inner(inner: GateConfig) -> Self {
        Self { inner }
    }
}

/// Every row of the knob table as a dict: `name`, `env`, `default`, `rule` (in words), `doc`,
/// and `home` (`"gate_config"` for `GateConfig` keywords, `"engine_core"` for the two knobs
/// only the engine half reads).
#[pyfunction(name = "knobs")]
fn knob_rows(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    no_panic("knobs", || {
        let rows = PyList::empty(py);
        for knob in KNOBS {
            let row = PyDict::new(py);
            row.set_item("name", knob.name)?;
            row.set_item("env", knob.env)?;
            row.set_item("default", value_to_py(py, knob.default)?)?;
            row.set_item("rule", knob.rule.describe())?;
            row.set_item("doc", knob.doc)?;
            let home = match knob.home {
                Home::GateConfig(_) => "gate_config",
                Home::EngineCore => "engine_core",
            };
            row.set_item("home", home)?;
            rows.append(row)?;
        }
        Ok(rows)
    })
}

/// The knob `name` from its `SESSION_GATE_*` variable (blank or unset: the default), checked
/// by its rule: `ValueError` naming knob and value if malformed, `KeyError` if no such knob.
#[pyfunction]
fn knob_from_env<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    no_panic("knob_from_env", || {
        let knob = table::knob(name)
            .ok_or_else(|| PyKeyError::new_err(format!("no knob named {name:?}")))?;
        value_to_py(py, knob.from_env()?)
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGateConfig>()?;
    m.add(
        "SCHEDULER_MAX_WAIT_SEC",
        crate::gate::knobs::SCHEDULER_MAX_WAIT_SEC,
    )?;
    m.add_function(wrap_pyfunction!(knob_rows, m)?)?;
    m.add_function(wrap_pyfunction!(knob_from_env, m)?)?;
    Ok(())
}
