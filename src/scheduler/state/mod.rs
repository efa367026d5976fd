//! Bytes every worker agrees on: the [`store::Store`] trait over shared data (with its
//! compare-and-swap), the versioned byte codec the tables are written in, and the fixed hashes
//! and levels that must give the same answer in every worker VM, process and machine.
//!
//! The floor of the scheduler: it imports no other room.

pub mod codec;
pub mod hash;
pub mod levels;
pub mod store;
