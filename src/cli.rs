//! The `session-gate` command line, shared by the Rust binary (`src/bin/session-gate.rs`) and the
//! wheel's console script (which reaches it through `session_gate._native.cli`), so both accept
//! exactly the same arguments and print the same help.
//!
//! Subcommands: `proxy` (here). `sim` (the replica twin) is Python: the wheel's console script
//! (`session_gate.cli`) dispatches it before this parser runs; the Rust binary alone answers it
//! with a pointer to the Python package.
use std::ffi::OsString;

use clap::{Parser, Subcommand};

use crate::proxy::{self, ProxyArgs, ProxyConfig};

/// Session-level admission gate for agentic rollouts on vLLM.
#[derive(Debug, Parser)]
#[command(name = "session-gate", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the proxy's flags does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// OpenAI-compatible proxy with one session gate per vLLM replica.
    Proxy(ProxyArgs),
    /// The replica twin (a simulated vLLM replica running the real gate; Python CLI
    /// `session_gate.sim`). `session-gate sim --help` lists its options.
    #[command(disable_help_flag = true)]
    Sim {
        /// Passed on to `python -m session_gate.sim`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

/// Runs the command line `args` (program name first) and returns the process exit code.
/// Help and version go to stdout with code 0, usage errors to stderr with code 2 (clap's codes);
/// nothing here calls `std::process::exit`, so an embedding interpreter shuts down normally.
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    match cli.command {
        Command::Proxy(args) => run_proxy(&args),
        Command::Sim { .. } => {
            eprintln!(
                "session-gate sim: the replica twin is part of the Python package; run it with \
                 the `session-gate` command the wheel installs (pip install session-gate), or \
                 `python -m session_gate.sim`"
            );
            2
        }
    }
}

fn run_proxy(args: &ProxyArgs) -> i32 {
    let config = match ProxyConfig::load(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("session-gate proxy: {e}");
            return 2;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("session-gate proxy: cannot start the runtime: {e}");
            return 1;
        }
    };
    match runtime.block_on(proxy::serve(config, shutdown_signal())) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("session-gate proxy: {e}");
            1
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM (the proxy then drains and exits 0).
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
