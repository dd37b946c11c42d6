//! The fast upstream of the load benchmark (`scripts/bench.sh`): answers every request, whatever
//! its method and path, with the same ~200 bytes of JSON over keep-alive HTTP/1.1, reading the
//! request body first so the connection stays reusable.
//!
//! `cargo run --release --example bench_upstream -- 127.0.0.1:0` prints the address it bound.

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

const JSON: &[u8] = br#"{"id":"pay_8e03978e40d543e8","object":"payment","amount":2000,"currency":"eur","status":"succeeded","customer":"cus_9s6XKzkNRiz8i3","created":1700000000,"livemode":false,"metadata":{"order":"6735"}}"#;

async fn answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    // A body that fails mid-way only costs this request its connection.
    let _ = req.into_body().collect().await;
    let mut response = Response::new(Full::new(Bytes::from_static(JSON)));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(response)
}

// One thread: the benchmark pins the upstream to one core beside the gateway.
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let Some(addr) = std::env::args().nth(1) else {
        eprintln!("usage: bench_upstream ADDR   (e.g. 127.0.0.1:0)");
        return ExitCode::from(2);
    };
    let addr: SocketAddr = match addr.parse() {
        Ok(addr) => addr,
        Err(error) => {
            eprintln!("bench_upstream: bad address {addr:?}: {error}");
            return ExitCode::from(2);
        }
    };
    let listener = match TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("bench_upstream: cannot listen on {addr}: {error}");
            return ExitCode::FAILURE;
        }
    };
    let bound = match listener.local_addr() {
        Ok(bound) => bound,
        Err(error) => {
            eprintln!("bench_upstream: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "{bound}")
        .and_then(|()| stdout.flush())
        .is_err()
    {
        return ExitCode::FAILURE;
    }
    drop(stdout);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors and the like: wait a little rather than spin.
                eprintln!("bench_upstream: accept failed: {error}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service_fn(answer))
                .await;
        });
    }
}
