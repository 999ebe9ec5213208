//! The `loams` binary: `loams demo` (the whole loop once, in one process, no network), `loams dev` (the same
//! stack, staying up), `loams phone` (a phone in the terminal), `loams sandbox` (the fake apps alone, as their own
//! process) and `loams bench`.

use loams::{config, demo, stack, terminal};

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "loams",
    version,
    about = "Loams Software Factory: production signal to verified fix"
)]
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
        /// Store and timers: the embedded `sqlite` file or `dynamodb` (setting `backend.store`).
        #[arg(long)]
        store: Option<StoreArg>,
        /// Work queue: the embedded `sqlite` file or `sqs` (setting `backend.queue`).
        #[arg(long)]
        queue: Option<QueueArg>,
        /// A local AWS emulator such as moto (setting `backend.aws_endpoint`); the table and queue are created there.
        #[arg(long, env = "LOAMS_AWS_ENDPOINT")]
        aws_endpoint: Option<String>,
        /// DynamoDB table name (setting `backend.table`).
        #[arg(long)]
        table: Option<String>,
        /// SQS queue name on the emulator (setting `backend.queue_name`).
        #[arg(long)]
        queue_name: Option<String>,
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
    /// A phone in the terminal, on the phones' core: register a device key, list and decide approvals, watch a run.
    Phone(terminal::PhoneArgs),
    /// Print a new P-256 private key (PKCS#8, base64) for a deployed stack's token issuer or agent cards.
    Keygen,
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

#[derive(Clone, Copy, clap::ValueEnum)]
enum StoreArg {
    Sqlite,
    Dynamodb,
}

impl From<StoreArg> for config::StoreKind {
    fn from(arg: StoreArg) -> Self {
        match arg {
            StoreArg::Sqlite => config::StoreKind::Sqlite,
            StoreArg::Dynamodb => config::StoreKind::Dynamodb,
        }
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum QueueArg {
    Sqlite,
    Sqs,
}

impl From<QueueArg> for config::QueueKind {
    fn from(arg: QueueArg) -> Self {
        match arg {
            QueueArg::Sqlite => config::QueueKind::Sqlite,
            QueueArg::Sqs => config::QueueKind::Sqs,
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LOAMS_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("loams: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Demo { data_dir } => demo::run(data_dir).await,
            Command::Dev {
                config,
                listen,
                data_dir,
                cassette,
                sandbox_state,
                store,
                queue,
                aws_endpoint,
                table,
                queue_name,
            } => {
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
                let backend = &mut config.backend;
                if let Some(store) = store {
                    backend.store = store.into();
                }
                if let Some(queue) = queue {
                    backend.queue = queue.into();
                }
                if aws_endpoint.is_some() {
                    backend.aws_endpoint = aws_endpoint;
                }
                if let Some(table) = table {
                    backend.table = table;
                }
                if let Some(name) = queue_name {
                    backend.queue_name = name;
                }
                config.validate()?;
                stack::dev(config, sandbox_state).await
            }
            Command::Token {
                config,
                data_dir,
                user,
            } => {
                let mut config = config::Config::load(config.as_deref())?;
                if let Some(dir) = data_dir {
                    config.data_dir = dir;
                }
                let issuer = stack::dev_issuer(&config.data_dir)?;
                println!("{}", stack::dev_token(&issuer, &user, &config.org)?);
                Ok(())
            }
            Command::Phone(args) => terminal::run(args).await,
            Command::Keygen => {
                let key = loams_api::Issuer::generate_pkcs8()
                    .map_err(|e| anyhow::anyhow!("generating a key: {e}"))?;
                println!(
                    "{}",
                    base64::Engine::encode(&base64::engine::general_purpose::STANDARD, key)
                );
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
