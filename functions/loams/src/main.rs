//! The `loams` binary: `loams demo` (the whole loop once, in one process, no network), `loams dev` (the same
//! stack, staying up), `loams sandbox` (the fake apps alone, as their own process) and `loams bench`.

use loams::{config, demo, stack};

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "loams", version, about = "Loams Software Factory: production signal to verified fix")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the whole loop once on the embedded store with the sandbox apps and a replayed model, then exit.
    Demo {
        /// Data directory for the embedded store (default: a fresh temporary directory).
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Run the stack and stay up.
    Dev {
        /// TOML configuration file (see docs/operations.md); flags below override it.
        #[arg(long, env = "LOAMS_CONFIG")]
        config: Option<PathBuf>,
        /// Address of the HTTP API.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Data directory of the embedded store.
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Replay this model cassette instead of calling a model endpoint.
        #[arg(long)]
        cassette: Option<PathBuf>,
        /// Apps' sandbox state file (only when the sandbox runs in-process).
        #[arg(long)]
        sandbox_state: Option<PathBuf>,
    },
    /// Print a bearer token of the dev issuer (the key in the data directory) for a user.
    Token {
        #[arg(long, env = "LOAMS_CONFIG")]
        config: Option<PathBuf>,
        #[arg(long)]
        data_dir: Option<PathBuf>,
        #[arg(long)]
        user: String,
    },
    /// Run only the sandbox apps (fake Zulip, Plane, Forgejo, GlitchTip, OpenPanel) and print their URLs as JSON.
    Sandbox {
        /// File the sandbox keeps its state in, so it survives restarts.
        #[arg(long)]
        state: Option<PathBuf>,
        /// Write the URLs and credentials as JSON to this file once listening.
        #[arg(long)]
        urls_file: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LOAMS_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("loams: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Demo { data_dir } => demo::run(data_dir).await,
            Command::Dev { config, listen, data_dir, cassette, sandbox_state } => {
                let mut config = config::Config::load(config.as_deref())?;
                if let Some(listen) = listen {
                    config.listen = listen;
                }
                if let Some(dir) = data_dir {
                    config.data_dir = dir;
                }
                if let Some(cassette) = cassette {
                    config.model.cassette = Some(cassette);
                }
                config.validate()?;
                stack::dev(config, sandbox_state).await
            }
            Command::Token { config, data_dir, user } => {
                let mut config = config::Config::load(config.as_deref())?;
                if let Some(dir) = data_dir {
                    config.data_dir = dir;
                }
                let issuer = stack::dev_issuer(&config.data_dir)?;
                println!("{}", stack::dev_token(&issuer, &user, &config.org)?);
                Ok(())
            }
            Command::Sandbox { state, urls_file } => stack::sandbox_only(state, urls_file).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loams: {e:#}");
            ExitCode::FAILURE
        }
    }
}
