//! `session-gate`: the command-line entry point. Subcommands: `proxy`.
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use session_gate::proxy::{self, ProxyArgs, ProxyConfig};

/// Session-level admission gate for agentic rollouts on vLLM.
#[derive(Debug, Parser)]
#[command(name = "session-gate", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// OpenAI-compatible proxy with one session gate per vLLM replica.
    Proxy(ProxyArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Proxy(args) => run_proxy(&args),
    }
}

fn run_proxy(args: &ProxyArgs) -> ExitCode {
    let config = match ProxyConfig::load(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("session-gate proxy: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("session-gate proxy: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let shutdown = async {
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
    };
    match runtime.block_on(proxy::serve(config, shutdown)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("session-gate proxy: {e}");
            ExitCode::FAILURE
        }
    }
}
