//! toolfleet-local: a fleet on one machine, for the demo, the bench and
//! the tests. Not linked into any production worker.
//!
//! # Layout
//!
//! - [`fleet`]: an orchestrator and any listed workers in one process. It
//!   knows no tool family: the caller builds each family's tools.
//! - [`servers`], [`cluster`], [`redis_cluster`]: the real servers as
//!   child processes, from `toolfleet-testkit` (which depends on no crate
//!   of the fleet), re-exported so `toolfleet up`, the demo and the bench
//!   find them beside the fleet.

pub mod fleet;

pub use toolfleet_testkit::{cluster, redis_cluster, servers};
