//! The admission gate: a sans-IO state machine ([`GateCore`]) that owns every decision, a
//! tokio driver ([`Gate`]) that carries out its probes and waits, the engine gate's book
//! ([`book`]), and the one table of knobs ([`knobs::KNOBS`]) behind [`GateConfig`].
//!
//! The decision tree, what FIFO means and how waiters are woken are documented on the
//! [`core`] module.
pub mod book;
pub mod config;
pub mod core;
pub mod driver;
pub mod infer;
pub mod knobs;
mod ledger;
pub mod metrics;
pub mod placement;
pub mod routers;
mod session;
pub mod testing;
pub mod types;

pub use self::config::{GateConfig, Pressure};
pub use self::core::GateCore;
pub use self::driver::{Gate, Lease, Probe, ProbeFuture};
/// A time with a total order (heap and map key), shared with the twin's event loop.
pub(crate) use self::ledger::TimeKey;
pub use self::metrics::GateStats;
pub use self::types::{
    Action, Admission, AttemptId, LeaseId, PrefixReport, ProbeKind, Reason, UsageReport,
};
