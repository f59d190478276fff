//! toolfleet-testkit: real servers as child processes for tests, the demo
//! and the bench. It depends on no crate of the fleet, so any crate (the
//! contract, the store, the worker SDK) can test against real servers
//! without compiling the orchestrator.
//!
//! # Layout
//!
//! - [`servers`]: `nats-server` and `redis-server` as child processes on
//!   free loopback ports, killed on drop, restartable on the same port.
//! - [`cluster`]: a JetStream cluster of `nats-server` nodes on loopback
//!   ports, a node killable and restartable (tests of replicated streams).
//! - [`redis_cluster`]: a Redis Cluster of `redis-server` masters, plain or
//!   TLS-only, optionally password-protected (the store's cluster mode).
//! - [`postgres`]: a PostgreSQL server with a fresh cluster on a free
//!   loopback port, the machine's or another installation (pgvector's).
//! - [`proxy`]: a TCP proxy in front of a server, to cut and refuse its
//!   connections (network faults between one client and a server).
//! - [`wait`]: the bound on every await of a test, and the next JSON
//!   message of a subscription within it.

pub mod cluster;
pub mod postgres;
pub mod proxy;
pub mod redis_cluster;
pub mod servers;
pub mod wait;
