//! The gateway's own HTTP/1.1: one codec, used in both directions.
//!
//! - `server`: the loop that reads plain requests from a client connection and writes their
//!   responses, in front of hyper for everything else.
//! - [`client`]: a request out and its response in, on one upstream connection.
//! - `codec`: what both share: how a body is framed (`Framing`), the `Content-Length`
//!   parser, the framing rules of a head's fields, the head writer's pieces, the read-chunk
//!   size.
//! - `chunked`: the chunked coding's decoder, and the pieces its writers use.
//! - `limits`: every limit on a head, the front service's and hyper's included.
//!
//! Why own it: hyper's server side and client connection cost a pass-through most of its
//! instructions (see BENCHMARKS.md, "Own HTTP/1.1 loop" and "Upstream client").

pub(crate) mod chunked;
pub mod client;
pub(crate) mod codec;
pub(crate) mod limits;
pub(crate) mod server;
