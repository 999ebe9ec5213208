//! loams-proto: the Loams client API types (prost + canonical proto3 JSON via pbjson), the canonical bytes a
//! device signs (approval decisions, run kills) and the canonical action an approval's hash covers, and a
//! hand-written Connect protocol server (axum) and client (reqwest).

mod action;
#[cfg(feature = "connect")]
pub mod connect;
mod signed;

pub use action::{canonical_action, canonical_json};
pub use signed::{
    DECISION_DOMAIN, KILL_DOMAIN, canonical_decision_bytes, canonical_kill_bytes, is_plain_text,
};

/// Generated code is not ours to lint.
macro_rules! generated {
    ($file:literal) => {
        include!(concat!(env!("OUT_DIR"), "/", $file, ".rs"));
        include!(concat!(env!("OUT_DIR"), "/", $file, ".serde.rs"));
    };
}

pub mod factory {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic)]
        generated!("loams.factory.v1");
    }
}

pub mod approvals {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic)]
        generated!("loams.approvals.v1");
    }
}

pub mod devices {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic)]
        generated!("loams.devices.v1");
    }
}

pub mod bot {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic)]
        generated!("loams.bot.v1");
    }
}

pub mod collab {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic)]
        generated!("loams.collab.v1");
    }
}
