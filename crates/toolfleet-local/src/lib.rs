//! toolfleet-local: a fleet on one machine, for the demo, the bench and
//! the tests. Not linked into any production worker.
//!
//! # Layout
//!
//! - [`servers`]: `nats-server` and `redis-server` as child processes on
//!   free loopback ports, killed on drop, restartable on the same port.
//! - [`cluster`]: a JetStream cluster of `nats-server` nodes on loopback
//!   ports, a node killable and restartable (tests of replicated streams).
//! - [`fleet`]: an orchestrator and any listed workers in one process. It
//!   knows no tool family: the caller builds each family's tools.

pub mod cluster;
pub mod fleet;
pub mod redis_cluster;
pub mod servers;
