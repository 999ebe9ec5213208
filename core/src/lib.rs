//! The phones' shared core (DESIGN.md section 8): API client, sync, SQLite cache, device keys, approvals, deep
//! links and push routing. No UI; the apps reach it through `loams-ffi`.
//!
//! Shape (after matrix-rust-sdk): a [`Client`] per account with sub-clients ([`Runs`], [`Approvals`],
//! [`Devices`], [`Bot`], [`Panels`]); owned records; one small [`Error`] enum; async methods on tokio; watches that deliver a
//! snapshot from the cache and then changes to a listener, and return a [`TaskHandle`] that stops them when
//! cancelled or dropped. Nothing is ever queued for sending: without a connection a write fails at once.

mod approvals;
mod bot;
mod cache;
mod client;
mod devices;
mod error;
mod follow;
mod panels;
mod route;
mod runs;
mod signer;
mod types;

pub use approvals::{ApprovalListener, ApprovalUpdate, Approvals};
pub use bot::{Bot, MAX_MESSAGE, ThreadListener, ThreadUpdate};
pub use client::{Client, ClientConfig, SyncMode, TaskHandle, TokenProvider};
pub use devices::Devices;
pub use error::{Error, Result};
pub use panels::{
    App, ChatMessage, ChatThread, CheckRun, CheckRuns, ErrorIssue, Issue, LinkTemplate,
    MetricPoint, MetricSeries, Panels, PullRequest,
};
pub use route::{AllowedApp, MAX_LINK, MAX_PUSH, Route, parse_link, parse_push};
pub use runs::{RunListener, RunSync, RunUpdate, Runs};
pub use signer::{DeviceSigner, P256_PUBLIC_KEY_LEN, SoftwareSigner};
pub use types::{
    Approval, ApprovalState, Budget, Decision, Device, Message, Risk, Run, RunLinks, Signal,
    Thread, TimelineEvent,
};
