//! toolfleet: the `toolfleet` command. The fleet itself lives in the
//! workspace's crates (see ARCHITECTURE.md); this package assembles them
//! for an operator.
//!
//! # Layout
//!
//! - [`cli`]: the command line — chat, demo, up, tools, index, bench,
//!   scripted-model.
//! - [`families`]: the tool families this command starts, by name. The
//!   only place here that names a family.
//! - [`bench`]: the load generator behind `toolfleet bench`.
//! - [`floor`]: the transport floors `toolfleet bench --floor` measures the
//!   fleet against (JetStream work queue, core request-reply).

pub mod bench;
pub mod cli;
pub mod families;
pub mod floor;
