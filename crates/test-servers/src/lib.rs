//! Real servers for idemgate's tests, started on free loopback ports and stopped by their own
//! pid when dropped: nothing a test did not start is ever touched.

pub mod postgres;
pub mod redis;

pub use postgres::PostgresServer;
pub use redis::RedisServer;
