//! The operator's commands on a running fleet: what it is doing
//! ([`status`], [`events`], [`health`]) and what a person decides for it
//! ([`cancel`], [`approve`], [`deadletters`]). Each module is one command:
//! its flags and its body.

pub mod approve;
pub mod cancel;
pub mod deadletters;
pub mod events;
pub mod health;
pub mod status;
