//! Real servers for idemgate's tests (a Redis, a Redis Cluster, PostgreSQL), started on free
//! loopback ports and stopped by their own pid when dropped: nothing a test did not start is
//! ever touched.

pub mod postgres;
pub mod redis;
pub mod redis_cluster;

pub use postgres::PostgresServer;
pub use redis::RedisServer;
pub use redis_cluster::RedisCluster;
