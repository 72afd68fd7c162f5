//! The broker shell: everything that talks AMQP — connecting, declaring the topology, the
//! relay loops and their supervisor, and reading and acting on the parking lot.

pub mod cancels;
pub mod connect;
pub mod declare;
pub mod drift;
pub mod holds;
pub mod lot;
pub mod relay;
pub mod session;
pub mod state;
pub mod stray;
pub mod supervisor;
pub mod topology;
pub mod watchdog;
